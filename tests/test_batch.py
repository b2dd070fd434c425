"""`selfrag batch`: input reading, resume bookkeeping and call merging (unit), then real runs on
Ray Data with the llama.cpp model and the session index (small requests: one segment, two
passages, 16 tokens)."""

from __future__ import annotations

import csv
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.batch import (
    BatchQuestion,
    CallMerger,
    done_ids,
    parse_shard,
    plan_jobs,
    plan_resources,
    read_questions,
    run_batch,
    select,
)
from pipeline.critique import Branch
from schemas.decoding import DecodingConfig
from tests.fakes import ScriptedCritic

SMALL = {"mode": "always", "top_k": 2, "max_segments": 1, "max_segment_tokens": 16}


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
    assert [p.line for p in problems] == [2, 4, 6, 7]
    assert "not JSON" in problems[0].reason
    assert "duplicate id 'a' (first at line 1)" in problems[1].reason
    assert "question" in problems[2].reason


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


def test_duplicates_share_a_job_and_bad_config_is_an_error_record():
    qs = [
        BatchQuestion("1", "Who founded Normandy?", {}, 1),
        BatchQuestion("2", "  who founded   NORMANDY? ", {}, 2),
        BatchQuestion("3", "Who founded Normandy?", {"top_k": 2}, 3),
        BatchQuestion("4", "Bad", {"top_k": 0}, 4),
        BatchQuestion("5", "Bad", {"nonsense": 1}, 5),
    ]
    jobs, errors = plan_jobs(qs, DecodingConfig())
    assert [j.ids for j in jobs] == [["1", "2"], ["3"]]
    assert [(e["id"], e["status"], e["error"]["type"]) for e in errors] == [
        ("4", "error", "invalid"),
        ("5", "error", "invalid"),
    ]
    assert "top_k" in errors[0]["error"]["message"]


def test_resources_split_the_cpus():
    assert plan_resources(2.0, None, 8, 0) == plan_resources(2.0, 1, 8, 0)  # 1.9 usable → 1
    two = plan_resources(2.0, 2, 8, 0)
    assert (two.actors, two.actor_cpus, two.n_threads) == (2, 0.95, 1)
    assert plan_resources(16.0, None, 8, 0).actors == 15


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


def test_a_question_past_its_timeout_gets_an_error_record():
    import time
    from types import SimpleNamespace

    from infra.batch import BatchAnswerer
    from pipeline.protocols import Passage
    from tests.fakes import ListRetriever

    class Slow(ScriptedCritic):
        def relevance(self, branches):  # type: ignore[no-untyped-def]
            time.sleep(0.3)
            return super().relevance(branches)

    critic = Slow()
    # The actor without its engine: the decoding path of one question around a slow critic.
    actor = object.__new__(BatchAnswerer)
    actor._rag = SimpleNamespace(critic=lambda source: critic)  # type: ignore[attr-defined]
    actor._store = ListRetriever([Passage("p1", "Rollo founded Normandy.")])  # type: ignore[attr-defined]
    actor._index_version, actor._model_id, actor._cache = "v", "m", None  # type: ignore[attr-defined]
    actor._merger = CallMerger(lambda source: critic, max_wait_s=0.01)  # type: ignore[attr-defined]
    config = DecodingConfig(mode="always", timeout_s=0.1)
    outcome = json.loads(actor._answer_one("Who founded Normandy?", config))
    assert outcome["status"] == "error" and outcome["error"]["type"] == "timeout"
    assert "timeout_s=0.1" in outcome["error"]["message"]
    ok = json.loads(actor._answer_one("Who founded Normandy?", DecodingConfig(mode="always")))
    assert ok["status"] == "ok" and ok["response"]["answer"]


# --- real: Ray Data, llama.cpp, embedded Qdrant --------------------------------------------------


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """Ray for this module (or the session's, when another module started it already)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


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
    from infra.settings import load_settings

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
    src.write_text("\n".join(lines) + "\n")
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
    assert len(ids) == len(set(ids)) == 12  # 10 + dup + bad; the broken line has no id
    assert summary.skipped == 4
    assert summary.malformed == 1 and summary.problems[0].line == 4
    assert summary.answered + summary.failed == 12 - 4
    by_id = {r["id"]: r for r in records}
    assert by_id["bad"]["status"] == "error" and by_id["bad"]["error"]["type"] == "invalid"
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
    assert (again.answered, again.failed, again.skipped) == (0, 0, 12)
    assert len(_records(out)) == 12


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

    from infra.cli import main

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
    from infra.cli import main

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
