"""`selfrag batch`: input reading, resume bookkeeping and call merging (unit), then real runs on
Ray Data with the llama.cpp model and the session index (small requests: one segment, two
passages, 16 tokens)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import selfrag.jobs.batch.batch_inputs as inputs_module
import selfrag.jobs.ray_pool as ray_pool
from selfrag.jobs.batch.batch_driver import plan_jobs, run_batch
from selfrag.jobs.batch.batch_inputs import BatchQuestion, parse_shard, read_questions, select
from selfrag.jobs.batch.batch_records import (
    OutputLockedError,
    compact_records,
    done_ids,
    earlier_answers,
    lock_output,
)
from selfrag.jobs.ray_pool import (
    ClusterTooSmall,
    NodeCPUs,
    NodeLost,
    NodeWatch,
    Resources,
    plan_resources,
)
from selfrag.pipeline.critics import Branch, settle_filters
from selfrag.runtime.answer_client import AnswerSite, LocalAnswerClient
from selfrag.runtime.answering import AnswerPath, KnownCritique
from selfrag.runtime.merging import CallMerger
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from tests.fakes import ScriptedCritic
from tests.paths import ROOT
from tests.suite import SUITE_ENV

# The likelihood critique: these tests are about the batch path, not the critique, and an
# answer must carry segments (the learned default abstains on unsupported answers).
SMALL = {
    "mode": "always",
    "top_k": 2,
    "max_segments": 1,
    "max_segment_tokens": 16,
    "critique": "likelihood",
}


# --- unit ---------------------------------------------------------------------------------------


def test_jsonl_malformed_lines_are_reported_with_their_numbers(tmp_path: Path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"id": "a", "question": "Who?"}\n'
        "{not json\n"
        '{"question": "Where?", "config": {"top_k": 2}}\n'
        '{"id": "a", "question": "Again?"}\n'
        "\n"
        '{"id": "c"}\n'
        '["a list"]\n'
    )
    questions, problems = read_questions(path)
    assert [(q.id, q.question, q.config) for q in questions] == [
        ("a", "Who?", {}),
        ("3", "Where?", {"top_k": 2}),
    ]
    # Unreadable rows get their own id, else their line; a repeated id gets no record.
    assert [(p.line, p.id) for p in problems] == [(2, "2"), (4, None), (6, "c"), (7, "7")]
    assert "not JSON" in problems[0].reason
    assert "duplicate id 'a' (first at line 1)" in problems[1].reason
    assert "question" in problems[2].reason


def test_a_non_utf8_line_is_one_problem_and_the_rest_is_read(tmp_path: Path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(
        b'{"id": "a", "question": "Who?"}\n'
        b'{"id": "latin", "question": "caf\xe9?"}\n'  # bad byte outside the id: id kept
        b'{"id": "\xff", "question": "x"}\n'  # bad byte in the id: the line number stands in
        b'{"id": "b", "question": "Where?"}\n'
    )
    questions, problems = read_questions(path)
    assert [q.id for q in questions] == ["a", "b"]
    assert [(p.line, p.id) for p in problems] == [(2, "latin"), (3, "3")]
    assert all("not UTF-8" in p.reason for p in problems)


def test_an_over_long_jsonl_line_is_skipped_by_line(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(inputs_module, "MAX_LINE_BYTES", 100)
    path = tmp_path / "q.jsonl"
    long_line = json.dumps({"id": "long", "question": "x" * 200})
    path.write_text(f'{{"question": "Who?"}}\n{long_line}\n{{"question": "Where?"}}\n')
    questions, problems = read_questions(path)
    assert [(q.id, q.question) for q in questions] == [("1", "Who?"), ("3", "Where?")]
    assert [(p.line, p.id) for p in problems] == [(2, "2")]
    assert f"line too long ({len(long_line)} bytes, limit 100)" in problems[0].reason


def test_csv_rows_over_the_field_limit_or_not_utf8_are_problems_by_line(tmp_path: Path):
    path = tmp_path / "q.csv"
    huge = "x" * (csv.field_size_limit() + 1)
    path.write_bytes(
        b"id,question\n"
        b"a,Who?\n"
        + f'big,"{huge}"\n'.encode()
        + b"b,Where?\n"
        + b"latin,caf\xe9?\n"
        + b"c,When?\n"
    )
    questions, problems = read_questions(path)
    assert [(q.id, q.question, q.line) for q in questions] == [
        ("a", "Who?", 2),
        ("b", "Where?", 4),
        ("c", "When?", 6),
    ]
    assert [(p.line, p.id) for p in problems] == [(3, "3"), (5, "latin")]
    assert "longer than the csv module's limit" in problems[0].reason
    assert "not UTF-8" in problems[1].reason


def test_csv_and_parquet_inputs(tmp_path: Path):
    csv_path = tmp_path / "q.csv"
    csv_path.write_text(
        'id,question,config\nx,"Who, then?","{""top_k"": 2}"\n,Where?,\ny,Bad config,{oops\n'
    )
    questions, problems = read_questions(csv_path)
    assert [(q.id, q.question, q.config) for q in questions] == [
        ("x", "Who, then?", {"top_k": 2}),
        ("3", "Where?", {}),
    ]
    assert [(p.line, "JSON" in p.reason) for p in problems] == [(4, True)]

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq_path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"id": ["p1", None], "question": ["Who?", "When?"]}), pq_path)
    questions, problems = read_questions(pq_path)
    assert [(q.id, q.question) for q in questions] == [("p1", "Who?"), ("2", "When?")]
    assert problems == []


DEEP = "[" * 100_000 + "]" * 100_000  # past the JSON parser's recursion limit
HUGE_INT = "9" * 5000  # past Python's 4,300-digit int() limit


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def test_hostile_jsonl_rows_are_problems_and_the_rest_is_read(tmp_path: Path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"id": "a", "question": "Who?"}\n'
        f'{{"id": "deep", "question": "Who?", "config": {DEEP}}}\n'
        f'{{"id": "huge", "question": "Who?", "config": {{"top_k": {HUGE_INT}}}}}\n'
        f'{{"id": "nested", "question": "Who?", "config": {_nested(40)}}}\n'
        f'{{"id": {HUGE_INT}, "question": "Who?"}}\n'
        '{"id": "b", "question": "Where?"}\n'
    )
    questions, problems = read_questions(path)
    assert [q.id for q in questions] == ["a", "b"]
    # The id cannot be read from a line that does not parse: its line number stands in.
    assert [(p.line, p.id) for p in problems] == [(2, "2"), (3, "3"), (4, "4"), (5, "5")]
    assert "nested too deeply" in problems[0].reason
    assert "more than 4300 digits" in problems[1].reason
    assert "nested deeper than 32 levels" in problems[2].reason
    assert "more than 4300 digits" in problems[3].reason


def test_hostile_csv_configs_are_problems_under_their_ids(tmp_path: Path):
    path = tmp_path / "q.csv"
    deep = "[" * 5000 + "]" * 5000  # within the csv module's field limit
    rows = [("a", "{}"), ("deep", deep), ("huge", f'{{"top_k": {HUGE_INT}}}')]
    rows += [("nested", _nested(40)), ("b", '{"top_k": 2}')]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "question", "config"])
        writer.writerows([(i, "Who?", config) for i, config in rows])
    questions, problems = read_questions(path)
    assert [(q.id, q.config) for q in questions] == [("a", {}), ("b", {"top_k": 2})]
    assert [(p.line, p.id) for p in problems] == [(3, "deep"), (4, "huge"), (5, "nested")]
    assert "'config' has arrays or objects nested too deeply" in problems[0].reason
    assert "'config' has an integer with more than 4300 digits" in problems[1].reason
    assert "'config' has arrays or objects nested deeper than 32" in problems[2].reason


def test_parquet_is_read_in_batches_and_an_oversized_row_is_a_problem(tmp_path: Path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(inputs_module, "MAX_LINE_BYTES", 100)
    monkeypatch.setattr(inputs_module, "PARQUET_BATCH_ROWS", 2)
    path = tmp_path / "q.parquet"
    ids = ["p1", "p2", "big", None, "p5"]
    qs = ["Who?", "When?", "x" * 200, "Where?", "Why?"]
    pq.write_table(pa.table({"id": ids, "question": qs}), path, row_group_size=3)
    questions, problems = read_questions(path)
    assert [(q.id, q.question, q.line) for q in questions] == [
        ("p1", "Who?", 1),
        ("p2", "When?", 2),
        ("4", "Where?", 4),
        ("p5", "Why?", 5),
    ]
    assert [(p.line, p.id) for p in problems] == [(3, "big")]
    assert "row too large" in problems[0].reason and "limit 100" in problems[0].reason


def test_a_hostile_output_line_is_skipped_like_a_torn_one(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    out.write_text(f'{{"id": "a", "status": "ok"}}\n{DEEP}\n{{"id": {HUGE_INT}}}\n')
    assert done_ids(out) == {"a"}
    assert compact_records(out) == 0
    assert earlier_answers(out, {"k"}) == {}


def test_shard_limit_and_resume_bookkeeping(tmp_path: Path):
    qs = [BatchQuestion(str(i), f"q{i}", {}, i) for i in range(10)]
    assert [q.id for q in select(qs, None, parse_shard("1/3"))] == ["1", "4", "7"]
    assert [q.id for q in select(qs, 2, parse_shard("0/2"))] == ["0", "2"]
    for bad in ("3/3", "x", "1/0"):
        with pytest.raises(ValueError):
            parse_shard(bad)
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "status": "ok"}\n{"id": "b", "status": "error"}\n{"id": "c", "sta')
    assert done_ids(out) == {"a", "b"}
    assert done_ids(out, retry_failed=True) == {"a"}


def test_the_last_record_of_an_id_counts_and_compaction_keeps_only_it(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    lines = [
        '{"id": "a", "status": "error", "n": 1}',
        '{"id": "b", "status": "ok", "n": 2}',
        '{"id": "a", "status": "ok", "n": 3}',
        '{"id": "b", "status": "error", "n": 4}',
        '{"id": "c", "sta',  # torn by a killed run: kept as it is, readers skip it
        '{"id": "d", "status": "ok", "n": 6}',
    ]
    out.write_text("\n".join(lines) + "\n")
    assert done_ids(out, retry_failed=True) == {"a", "d"}
    assert compact_records(out) == 2
    assert out.read_text().splitlines() == [lines[2], lines[3], lines[4], lines[5]]
    assert compact_records(out) == 0


def _all_offline_rows(path: Path) -> None:
    """Rows that need no model: two invalid configs and one unreadable line."""
    path.write_bytes(
        b'{"id": "a", "question": "Who?", "config": {"top_k": 0}}\n'
        b'{"id": "b", "question": "Where?", "config": {"top_k": 0}}\n'
        b'{"id": "c", "question": "\xff"}\n'
    )


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path: Path):
    src, out = tmp_path / "q.jsonl", tmp_path / "out" / "answers.jsonl"
    _all_offline_rows(src)
    settings = _offline_settings(tmp_path)
    # The first writer: another process, as a second `selfrag batch` would be.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path\n"
            "from selfrag.jobs.batch.batch_records import lock_output\n"
            "with lock_output(Path(sys.argv[1])):\n"
            "    print('held', flush=True); sys.stdin.read()",
            str(out),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(OutputLockedError) as refused:
            run_batch(settings, src, out, progress=False)
        assert str(out) in str(refused.value) and f"pid {holder.pid}" in str(refused.value)
        assert not out.exists()  # the refused run wrote nothing
    finally:
        holder.kill()  # dies holding the lock: the OS releases it
        holder.wait(10)
    summary = run_batch(settings, src, out, progress=False)
    assert (summary.failed, summary.malformed) == (2, 1)
    assert sorted(r["id"] for r in _records(out)) == ["a", "b", "c"]
    # In one process too: each lock_output is its own open file, so they exclude each other.
    with lock_output(out), pytest.raises(OutputLockedError):
        run_batch(settings, src, out, progress=False)


def test_retry_failed_answers_again_only_the_ids_whose_last_record_is_an_error(tmp_path: Path):
    src, out = tmp_path / "q.jsonl", tmp_path / "answers.jsonl"
    _all_offline_rows(src)
    settings = _offline_settings(tmp_path)
    old = [
        {"id": "a", "status": "ok", "question": "Who?", "response": {"answer": "kept"}},
        {"id": "b", "status": "error", "question": "Where?", "error": {"type": "timeout"}},
    ]
    out.write_text("".join(json.dumps(r) + "\n" for r in old))

    plain = run_batch(settings, src, out, progress=False)
    assert (plain.skipped, plain.retried, plain.malformed) == (2, 0, 1)
    assert [r["id"] for r in _records(out)] == ["a", "b", "c"]  # only the new id, c

    retry = run_batch(settings, src, out, progress=False, retry_failed=True)
    assert (retry.skipped, retry.retried, retry.failed, retry.malformed) == (1, 2, 1, 1)
    records = _records(out)
    # One record per id after the run; b's and c's are the new ones, a's untouched.
    assert sorted(r["id"] for r in records) == ["a", "b", "c"]
    by_id = {r["id"]: r for r in records}
    assert by_id["a"] == old[0]
    assert by_id["b"]["error"]["type"] == "invalid" and "top_k" in by_id["b"]["error"]["message"]
    assert by_id["c"]["error"]["type"] == "malformed" and by_id["c"]["line"] == 3


def _settling(defaults: DecodingConfig) -> LocalAnswerClient:
    """An answer client settling configs as a model whose `auto` is the likelihood critique
    (the driver only settles: nothing is decoded in it)."""

    def no_decode(*_: object) -> AnswerResponse:
        raise AssertionError("the driver decodes nothing")

    path = AnswerPath(defaults, facts=KnownCritique("auto", "likelihood", {}))
    return LocalAnswerClient(lambda _collection: AnswerSite(path, no_decode))


def test_duplicates_share_a_job_and_bad_config_is_an_error_record():
    qs = [
        BatchQuestion("1", "Who founded Normandy?", {}, 1),
        BatchQuestion("2", "  who founded   NORMANDY? ", {}, 2),
        BatchQuestion("3", "Who founded Normandy?", {"top_k": 2}, 3),
        BatchQuestion("4", "Bad", {"top_k": 0}, 4),
        BatchQuestion("5", "Bad", {"nonsense": 1}, 5),
    ]
    jobs, errors = plan_jobs(qs, _settling(DecodingConfig()))
    assert [j.ids for j in jobs] == [["1", "2"], ["3"]]
    assert all(j.config.critique == "likelihood" and j.config.min_relevance == 0 for j in jobs)
    assert [(e["id"], e["status"], e["error"]["type"]) for e in errors] == [
        ("4", "error", "invalid"),
        ("5", "error", "invalid"),
    ]
    assert "top_k" in errors[0]["error"]["message"]


def test_a_duplicate_of_an_id_answered_by_an_earlier_run_reuses_its_answer(tmp_path: Path):
    """A killed run may have written the first id of a duplicate but not the others; the next
    run must not decode the question again."""
    client = _settling(DecodingConfig(top_k=2))
    jobs, _ = plan_jobs([BatchQuestion("dup", "WHO founded Normandy?", {"top_k": 2}, 1)], client)
    # The earlier run's response holds the settled config it was decoded with.
    response = {"answer": "Rollo", "config": jobs[0].config.model_dump(mode="json")}
    out = tmp_path / "a.jsonl"
    out.write_text(
        json.dumps(
            {"id": "q0", "status": "ok", "question": "Who founded Normandy?", "response": response}
        )
        + "\n"
        + json.dumps({"id": "e1", "status": "error", "question": "Who founded Normandy?"})
        + "\n{torn"
    )
    assert earlier_answers(out, {jobs[0].key}) == {jobs[0].key: ("q0", response)}
    other, _ = plan_jobs([BatchQuestion("x", "Who founded Normandy?", {"top_k": 3}, 1)], client)
    assert earlier_answers(out, {other[0].key}) == {}  # another config is another answer


def test_resources_split_the_cpus():
    assert plan_resources(2.0, None, 8, 0) == plan_resources(2.0, 1, 8, 0)  # 1.9 usable → 1
    two = plan_resources(2.0, 2, 8, 0)
    assert (two.actors, two.actor_cpus, two.n_threads) == (2, 0.95, 1)
    assert plan_resources(16.0, None, 8, 0).actors == 15


def test_resources_fit_each_node_not_the_clusters_sum():
    """Two nodes of one CPU: the sum (2) would make one actor of 1.9 CPUs, which no node can
    hold, and Ray would queue it for ever. The driver's node keeps the retriever's share."""
    nodes = [NodeCPUs("head", 1.0, driver=True), NodeCPUs("worker", 1.0)]
    plan = plan_resources(nodes, None, 8, 0)
    assert (plan.actors, plan.actor_cpus, plan.n_threads) == (2, 0.9, 1)
    assert plan_resources(nodes, 3, 8, 0).actor_cpus == 0.5  # 0.9 → 1, 1.0 → 2
    assert plan_resources(nodes, None, 8, 0, actor_cpus=0.3).actors == 6
    with pytest.raises(ClusterTooSmall, match="asked for 3 engine actors of 1 CPU each") as e:
        plan_resources(nodes, 3, 8, 0, actor_cpus=1.0)
    assert "the cluster has 2 nodes with CPUs free: head (the driver's) 1, worker 1" in str(e.value)
    with pytest.raises(ClusterTooSmall, match=r"engine actors of 1\.5 CPU each"):
        plan_resources(nodes, None, 8, 0, actor_cpus=1.5)
    with pytest.raises(ClusterTooSmall, match="the cluster has 1 node with CPUs free"):
        plan_resources([NodeCPUs("busy", 0.0, driver=True)], None, 8, 0)
    # With a Qdrant server there is no retriever to keep room for.
    assert plan_resources(nodes, None, 8, 0, reserve=0.0).actor_cpus == 1.0


def test_a_lost_node_stops_the_run_only_when_the_pool_no_longer_fits():
    """Two actors of 0.9 CPU on two 1-CPU nodes: losing the worker leaves no room for its
    actor (the head holds one and the retriever); with a third node it restarts there."""
    plan = Resources(actors=2, actor_cpus=0.9, n_threads=1, per_actor=8)
    head, worker, spare = (
        NodeCPUs("head0000aa", 1.0, driver=True),
        NodeCPUs("work0000bb", 1.0),
        NodeCPUs("spare000cc", 1.0),
    )
    nodes = [head, worker, spare]
    watch = NodeWatch(plan, 0.1, lambda: nodes)
    watch.check()  # all there
    nodes = [head, spare]
    watch.check()  # the worker's actor fits the spare node: Ray Data restarts it there
    nodes = [head]
    with pytest.raises(NodeLost) as e:
        watch.check()
    assert str(e.value) == (
        "nodes spare000, work0000 left the cluster mid-run, and the 2 engine actors of "
        "0.9 CPU each no longer fit the nodes left (head0000 1 CPU)"
    )


class _BlockingRows:
    """A Dataset whose rows come only when released, as Ray Data's do while a node is lost."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.closed = threading.Event()

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        try:
            yield {"n": 0}
            self.release.wait(30)
            yield {"n": 1}
        finally:
            self.closed.set()


class _Watch:
    def __init__(self, fail_after: int) -> None:
        self.calls, self.fail_after = 0, fail_after

    def check(self) -> None:
        self.calls += 1
        if self.calls >= self.fail_after:
            raise NodeLost("gone")


def test_rows_are_watched_while_none_come_and_a_lost_node_ends_the_wait():
    ds = _BlockingRows()
    rows = ray_pool.rows_watched(ds, _Watch(fail_after=2), every_s=0.05)
    assert next(rows) == {"n": 0}
    with pytest.raises(NodeLost):
        next(rows)  # the second row never comes; the watch raises instead of waiting 30 s
    ds.release.set()
    assert ds.closed.wait(5)  # the reader stops at its next row and closes the iterator


def test_watched_rows_pass_through_and_raise_the_iterations_error():
    class Failing:
        def iter_rows(self) -> Iterator[dict[str, Any]]:
            yield {"n": 0}
            raise RuntimeError("block failed")

    rows = ray_pool.rows_watched(Failing(), _Watch(fail_after=10**9), every_s=0.05)
    assert next(rows) == {"n": 0}
    with pytest.raises(RuntimeError, match="block failed"):
        next(rows)


def test_merger_runs_the_calls_of_concurrent_decoders_as_one_engine_call():
    critic = ScriptedCritic()
    merger = CallMerger(lambda source: critic, max_wait_s=5.0)
    n = 4
    results: dict[int, Any] = {}
    for _ in range(n):
        merger.enter()

    def work(i: int) -> None:
        branches = [Branch(f"q{i}", "", None)] * (i + 1)
        results[i] = merger.call("relevance", "auto", branches)
        merger.leave()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert critic.calls == ["relevance:10"]  # 1 + 2 + 3 + 4 branches, one engine call
    assert [len(results[i]) for i in range(n)] == [1, 2, 3, 4]


def test_merger_isolates_a_failing_call():
    class Picky(ScriptedCritic):
        def relevance(self, branches):  # type: ignore[no-untyped-def]
            if any(b.question == "bad" for b in branches):
                raise RuntimeError("model error")
            return super().relevance(branches)

    critic = Picky()
    merger = CallMerger(lambda source: critic, max_wait_s=5.0)
    outcome: dict[str, Any] = {}
    merger.enter()
    merger.enter()

    def work(q: str) -> None:
        try:
            outcome[q] = len(merger.call("relevance", "auto", [Branch(q, "", None)]))
        except RuntimeError as exc:
            outcome[q] = str(exc)
        merger.leave()

    threads = [threading.Thread(target=work, args=(q,)) for q in ("good", "bad")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert outcome == {"good": 1, "bad": "model error"}


def _worker_without_engine(rag: Any, critic: Any) -> Any:
    """An `EngineWorker` around a scripted critic: its merger, no model loaded."""
    from selfrag.runtime.engine_worker import EngineWorker

    worker = object.__new__(EngineWorker)
    worker.rag = rag
    worker._merger = CallMerger(lambda source: critic, max_wait_s=0.01)
    return worker


def test_a_question_past_its_timeout_gets_an_error_record():
    import time
    from types import SimpleNamespace

    from selfrag.jobs.batch.batch_actors import BatchAnswerer
    from selfrag.pipeline.protocols import Passage
    from tests.fakes import ListRetriever

    class Slow(ScriptedCritic):
        def relevance(self, branches):  # type: ignore[no-untyped-def]
            time.sleep(0.3)
            return super().relevance(branches)

    critic = Slow()
    # The actor without its engine: the decoding path of one question around a slow critic.
    actor = object.__new__(BatchAnswerer)
    actor._rag = SimpleNamespace(  # type: ignore[attr-defined]
        critic=lambda source: critic,
        store=ListRetriever([Passage("p1", "Rollo founded Normandy.")]),
    )
    actor._retriever = None  # type: ignore[attr-defined]
    actor._index_version, actor._model_id = "v", "m"  # type: ignore[attr-defined]
    actor._path = AnswerPath(DecodingConfig())  # type: ignore[attr-defined]
    actor._worker = _worker_without_engine(actor._rag, critic)  # type: ignore[attr-defined]
    # The driver hands the actor settled configs.
    config = settle_filters(DecodingConfig(mode="always", timeout_s=0.1), "scripted")
    outcome = json.loads(actor._answer_one("Who founded Normandy?", config))
    assert outcome["status"] == "error" and outcome["error"]["type"] == "deadline_exceeded"
    assert "timeout_s=0.1" in outcome["error"]["message"]
    settled = settle_filters(DecodingConfig(mode="always"), "scripted")
    ok = json.loads(actor._answer_one("Who founded Normandy?", settled))
    assert ok["status"] == "ok" and ok["response"]["answer"]


def test_batch_caches_answers_under_the_online_endpoints_key():
    from types import SimpleNamespace

    from selfrag.jobs.batch.batch_actors import BatchAnswerer
    from selfrag.pipeline.protocols import Passage
    from selfrag.runtime.answering import query_key
    from tests.fakes import ListRetriever

    class DictCache(dict):
        def put(self, key, response):  # type: ignore[no-untyped-def]
            self[key] = response

    critic = ScriptedCritic()
    actor = object.__new__(BatchAnswerer)
    actor._rag = SimpleNamespace(  # type: ignore[attr-defined]
        critic=lambda source: critic,
        model_fingerprint="m sha256:abc",
        store=ListRetriever([Passage("p1", "Rollo founded Normandy.")]),
    )
    actor._retriever = None  # type: ignore[attr-defined]
    actor._index_version, actor._model_id = "v", "m"  # type: ignore[attr-defined]
    cache = DictCache()
    scope = {"calibration": {"a": 1}}
    actor._path = AnswerPath(  # type: ignore[attr-defined]
        DecodingConfig(), cache=cache, cache_scope=scope
    )
    actor._worker = _worker_without_engine(actor._rag, critic)  # type: ignore[attr-defined]
    config = settle_filters(DecodingConfig(mode="always"), "scripted")
    assert json.loads(actor._answer_one("Who founded Normandy?", config))["cache"] == "miss"
    assert list(cache) == [query_key("Who founded Normandy?", config, "v", "m sha256:abc", scope)]
    assert json.loads(actor._answer_one("who founded normandy?", config))["cache"] == "hit"


def test_the_actors_client_retrieves_with_its_store_and_merged_critic():
    from types import SimpleNamespace

    from selfrag.jobs.batch.batch_actors import BatchAnswerer
    from selfrag.pipeline.protocols import Passage
    from selfrag.schemas.retrieval import RetrieveRequest
    from tests.fakes import ListRetriever

    critic = ScriptedCritic(relevance_of={"p1": 0.2, "p2": 0.9})
    actor = object.__new__(BatchAnswerer)
    actor._rag = SimpleNamespace(  # type: ignore[attr-defined]
        critic=lambda source: critic,
        store=ListRetriever([Passage("p1", "Rollo."), Passage("p2", "Normandy.")]),
    )
    actor._retriever = None  # type: ignore[attr-defined]
    actor._index_version, actor._model_id = "v", "m"  # type: ignore[attr-defined]
    facts = KnownCritique("auto", "learned", {})
    actor._path = AnswerPath(DecodingConfig(), facts=facts)  # type: ignore[attr-defined]
    actor._worker = _worker_without_engine(actor._rag, critic)  # type: ignore[attr-defined]
    ranked = actor._client.retrieve(RetrieveRequest(query="Who founded Normandy?", top_k=2))
    assert [(p.id, p.s_rel) for p in ranked] == [("p2", 0.9), ("p1", 0.2)]
    assert critic.calls == ["relevance:2"]


def _offline_settings(tmp_path: Path) -> Any:
    from selfrag.infra.settings_loader import load_settings

    return load_settings(environ={"SELFRAG_HOME": str(tmp_path / "home"), **SUITE_ENV})


# --- real: Ray Data, llama.cpp, embedded Qdrant --------------------------------------------------


@pytest.mark.real
def test_actor_calls_keep_to_the_answers_deadline_and_bring_store_errors_back(
    ray_local: None,
) -> None:
    import time

    import ray

    from selfrag.runtime.answering import Deadline
    from selfrag.runtime.remote_retriever import RemoteRetriever, actor_call
    from selfrag.schemas.errors import DeadlineExceeded, DependencyDown

    @ray.remote
    class Store:
        def search_many(self, queries: list[str], k: int) -> list[list[str]]:
            return [[f"{q}:{i}" for i in range(k)] for q in queries]

        def search(self, query: str, k: int) -> list[str]:
            time.sleep(5)
            return []

        def index_version(self) -> str:
            raise DependencyDown("the passage store does not answer")

    handle = Store.remote()  # type: ignore[attr-defined]
    remote = RemoteRetriever(actor_call(handle, Deadline(30)))
    assert remote.search_many(["a", "b"], 2) == [["a:0", "a:1"], ["b:0", "b:1"]]
    with pytest.raises(DependencyDown, match="does not answer"):
        remote.index_version()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        RemoteRetriever(actor_call(handle, Deadline(0.5))).search("slow", 1)
    assert time.monotonic() - started < 2.0
    ray.kill(handle)


@pytest.fixture(scope="module")
def normans_questions(normans_squad: Path) -> list[str]:
    data = json.loads(normans_squad.read_text())
    qs = [qa["question"] for p in data["data"][0]["paragraphs"] for qa in p["qas"]]
    return list(dict.fromkeys(qs))


class _Killed(Exception):
    pass


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.real
def test_batch_kill_resume_duplicates_and_errors(
    ray_local: None, indexed_home: Path, normans_questions: list[str], tmp_path: Path
):
    from selfrag.infra.settings_loader import load_settings

    settings = load_settings(overrides={"home": str(indexed_home)})
    lines = [
        json.dumps({"id": f"q{i}", "question": q, "config": SMALL})
        for i, q in enumerate(normans_questions[:10])
    ]
    lines.insert(3, "{broken")  # line 4
    lines.append(
        json.dumps({"id": "dup", "question": normans_questions[0].upper(), "config": SMALL})
    )
    lines.append(json.dumps({"id": "bad", "question": "x", "config": {"top_k": 0}}))
    src = tmp_path / "questions.jsonl"
    # Line 14 is not UTF-8: one error record under its id, and the run goes on.
    latin = b'{"id": "latin", "question": "caf\xe9?", "config": {"top_k": 2}}\n'
    src.write_bytes(("\n".join(lines) + "\n").encode() + latin)
    out = tmp_path / "answers.jsonl"

    seen = 0

    def kill_after_four(record: dict[str, Any]) -> None:
        nonlocal seen
        seen += 1
        if seen == 4:
            raise _Killed

    with pytest.raises(_Killed):
        run_batch(
            settings,
            src,
            out,
            actors=1,
            per_actor=4,
            progress=False,
            actor_cpus=0.5,
            on_record=kill_after_four,
        )
    first = _records(out)
    assert len(first) == 4
    summary = run_batch(settings, src, out, actors=1, per_actor=8, progress=False, actor_cpus=0.5)
    records = _records(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == 14  # 10 + dup + bad + the broken and the Latin-1 line
    assert summary.skipped == 4
    assert summary.malformed == 0  # both unreadable lines got their records in the first run
    assert summary.answered + summary.failed == 14 - 4
    by_id = {r["id"]: r for r in records}
    assert by_id["bad"]["status"] == "error" and by_id["bad"]["error"]["type"] == "invalid"
    assert (by_id["4"]["error"]["type"], by_id["4"]["line"]) == ("malformed", 4)
    assert by_id["latin"]["error"]["type"] == "malformed" and by_id["latin"]["line"] == 14
    assert "not UTF-8" in by_id["latin"]["error"]["message"]
    assert by_id["dup"]["status"] == "ok"
    assert by_id["dup"]["response"] == by_id["q0"]["response"]
    for i in range(10):
        r = by_id[f"q{i}"]
        assert r["status"] == "ok", r
        resp = r["response"]
        assert resp["answer"] and resp["usage"]["retrievals"] == 1
        assert resp["config"]["top_k"] == 2 and len(resp["passages"]) >= 1
    # A third run has nothing left to do.
    again = run_batch(settings, src, out, progress=False)
    assert (again.answered, again.failed, again.skipped) == (0, 0, 14)
    assert len(_records(out)) == 14


@pytest.mark.real
def test_batch_retry_failed_answers_an_error_id_again(
    ray_local: None, indexed_home: Path, normans_questions: list[str], tmp_path: Path
):
    from selfrag.infra.settings_loader import load_settings

    settings = load_settings(overrides={"home": str(indexed_home)})
    src, out = tmp_path / "q.jsonl", tmp_path / "a.jsonl"
    rows = [
        {"id": f"q{i}", "question": q, "config": SMALL} for i, q in enumerate(normans_questions[:2])
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    earlier = [
        {"id": "q0", "status": "error", "error": {"type": "timeout", "message": "earlier"}},
        {"id": "q1", "status": "ok", "question": rows[1]["question"], "response": {"answer": "x"}},
    ]
    out.write_text("".join(json.dumps(r) + "\n" for r in earlier))
    summary = run_batch(
        settings, src, out, actors=1, progress=False, actor_cpus=0.5, retry_failed=True
    )
    assert (summary.answered, summary.retried, summary.skipped) == (1, 1, 1)
    records = _records(out)
    assert [r["id"] for r in records] == ["q1", "q0"]  # q0's error record replaced
    assert records[0] == earlier[1]
    assert records[1]["status"] == "ok" and records[1]["response"]["answer"]


@pytest.mark.real
def test_batch_cli_reads_csv_and_parquet(
    ray_local: None,
    indexed_home: Path,
    normans_questions: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from selfrag.cli import main

    config = json.dumps(SMALL)
    csv_path = tmp_path / "q.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "question", "config"])
        writer.writerows([f"c{i}", q, config] for i, q in enumerate(normans_questions[:2]))
    pq_path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"question": normans_questions[2:4], "config": [config] * 2}), pq_path)
    for src, ids in ((csv_path, {"c0", "c1"}), (pq_path, {"1", "2"})):
        out = tmp_path / f"{src.suffix[1:]}.jsonl"
        code = main(
            [
                "--home",
                str(indexed_home),
                "batch",
                str(src),
                "--out",
                str(out),
                "--actors",
                "1",
                "--no-progress",
            ]
        )
        assert code == 0
        assert "answered=2 failed=0 skipped=0" in capsys.readouterr().out
        records = _records(out)
        assert {r["id"] for r in records} == ids
        assert all(r["status"] == "ok" and r["response"]["segments"] for r in records)


@pytest.mark.real
def test_eval_ray_answers_selfrag_systems_on_the_batch_path(
    ray_local: None,
    indexed_home: Path,
    normans_squad: Path,
    indexed_corpus: list[str],
    tmp_path: Path,
):
    from selfrag.cli import main

    out = tmp_path / "eval"
    args = [
        "--home",
        str(indexed_home),
        "eval",
        str(normans_squad),
        "--corpus",
        *indexed_corpus,
        "--systems",
        "selfrag-likelihood",
        "--limit",
        "2",
        "--ray",
        "--actors",
        "1",
        "--out",
        str(out),
        "--no-progress",
        "--mode",
        "always",
        "--top-k",
        "2",
        "--max-segments",
        "1",
        "--max-segment-tokens",
        "16",
    ]
    assert main(args) == 0
    records = _records(out / "records.jsonl")
    assert [r["system"] for r in records] == ["selfrag-likelihood"] * 2
    report = json.loads((out / "report.json").read_text())
    assert report["systems"]["selfrag-likelihood"]["questions"] == 2


def test_a_question_of_only_control_or_zero_width_characters_is_an_invalid_record():
    """Like an empty question: nothing visible to answer."""
    questions = [
        BatchQuestion("ok", "Who founded Normandy?", {}, 1),
        BatchQuestion("blank", "\u200b\u200c\x07\x1b\ufeff", {}, 2),
    ]
    jobs, errors = plan_jobs(questions, _settling(DecodingConfig()))
    assert [j.ids for j in jobs] == [["ok"]]
    assert [e["id"] for e in errors] == ["blank"]
    assert errors[0]["error"]["type"] == "invalid"
    assert "visible text" in errors[0]["error"]["message"]
