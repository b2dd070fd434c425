"""`selfrag batch`: answer a file of questions on Ray Data, with nothing lost.

* Input: JSONL `{id?, question, config?}`, CSV (columns `id?`, `question`, `config?` as JSON) or
  Parquet (same columns). A row without an id gets its line (JSONL/CSV) or row number.
* The driver drops ids already in the output file (resume), writes an error record for every
  request that does not validate, and answers each distinct (question, effective config) once
  (`actors.service.query_key`); every id of a duplicate gets the same answer.
* Ray Data runs `BatchAnswerer`, a pool of actors each owning one llama.cpp engine. An actor
  decodes a batch of questions in threads; `CallMerger` turns their per-step critique calls
  into one multi-sequence engine call, the way `BranchPool` merges concurrent HTTP requests.
* Embedded Qdrant allows one client per folder, so with it a single `RetrieverActor` owns the
  store (and the embedder) and the engine actors search through it; with `qdrant_url` set each
  actor opens its own client.
* The driver appends one JSON line per id and flushes it as results stream back, so a killed
  run loses at most the batches in flight, and the same command resumes it.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from tqdm import tqdm

from pipeline.critique import Branch, Critic, LabelProbs
from pipeline.decoder import SelfRAGDecoder
from pipeline.protocols import Generation, Passage
from schemas.answer import AnswerRequest, AnswerResponse
from schemas.decoding import DecodingConfig
from schemas.settings import Settings

# Seconds a critique call waits for the other decoder threads of its actor before it runs
# alone. The threads' searches queue at one retriever (~0.1 s each on a loaded 2-core box),
# while a merged engine call takes seconds, so waiting for stragglers pays.
MERGE_WAIT_S = 0.3
RETRIEVER_CPUS = 0.1


class BatchInputError(ValueError):
    """The input file cannot be read at all (missing, unknown format)."""


class Cancelled(Exception):
    """A question ran past its `timeout_s`; its decoder stops at the next critique call."""


# --- input ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchQuestion:
    """One input row: its id, the question, its config overrides and where it came from."""

    id: str
    question: str
    config: dict[str, Any]
    line: int


@dataclass(frozen=True)
class InputProblem:
    """A row that could not be read; reported with its line (or row) number and skipped."""

    line: int
    reason: str


def read_questions(path: Path) -> tuple[list[BatchQuestion], list[InputProblem]]:
    """Rows of a JSONL, CSV or Parquet file; malformed rows and repeated ids become problems."""
    if not path.is_file():
        raise BatchInputError(f"no such file: {path}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        rows = _jsonl_rows(path)
    elif suffix == ".csv":
        rows = _csv_rows(path)
    elif suffix in (".parquet", ".pq"):
        rows = _parquet_rows(path)
    else:
        raise BatchInputError(f"{path}: unknown input format {suffix!r} (jsonl, csv or parquet)")
    questions: list[BatchQuestion] = []
    problems: list[InputProblem] = []
    first_line: dict[str, int] = {}
    for line, row in rows:
        if isinstance(row, str):
            problems.append(InputProblem(line, row))
            continue
        try:
            q = _question(line, row)
        except ValueError as exc:
            problems.append(InputProblem(line, str(exc)))
            continue
        if q.id in first_line:
            reason = f"duplicate id {q.id!r} (first at line {first_line[q.id]})"
            problems.append(InputProblem(line, reason))
            continue
        first_line[q.id] = line
        questions.append(q)
    return questions, problems


def _question(line: int, row: dict[str, Any]) -> BatchQuestion:
    question = row.get("question")
    if not isinstance(question, str):
        raise ValueError("no 'question' string")
    raw_id = row.get("id")
    ident = str(line) if raw_id is None or raw_id == "" else str(raw_id)
    config = row.get("config")
    if config is None or config == "":
        config = {}
    elif isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'config' is not JSON: {exc.msg}") from None
    if not isinstance(config, dict):
        raise ValueError("'config' must be an object")
    return BatchQuestion(ident, question, config, line)


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    with path.open(encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                yield n, f"not JSON: {exc.msg}"
                continue
            yield n, row if isinstance(row, dict) else "not a JSON object"


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "question" not in reader.fieldnames:
            raise BatchInputError(f"{path}: no 'question' column")
        for row in reader:
            # line_num is the physical line the row ended on; quoted newlines stay correct.
            if None in row:
                yield reader.line_num, "more fields than the header"
                continue
            yield reader.line_num, dict(row)


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if "question" not in table.column_names:
        raise BatchInputError(f"{path}: no 'question' column")
    yield from enumerate(table.to_pylist(), 1)


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """`i/n` (0 <= i < n) as (i, n)."""
    if spec is None:
        return None
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be i/n, got {spec!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard i/n needs 0 <= i < n, got {spec!r}")
    return i, n


def select(
    questions: Sequence[BatchQuestion], limit: int | None, shard: tuple[int, int] | None
) -> list[BatchQuestion]:
    """The rows this run owns: every n-th from the i-th (by input position), then the first
    `limit`. Depends only on the input, so a rerun selects the same rows."""
    chosen = list(questions)
    if shard is not None:
        i, n = shard
        chosen = chosen[i::n]
    return chosen[:limit] if limit is not None else chosen


# --- output --------------------------------------------------------------------------------------


def done_ids(path: Path) -> set[str]:
    """Ids with a record in `path` already; a torn last line (killed mid-write) is ignored."""
    if not path.exists():
        return set()
    ids: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for text in f:
            try:
                ids.add(str(json.loads(text)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ids


class RecordSink:
    """Appends one JSON line per record and flushes it, so a crash loses nothing written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        if self._file.tell() and not path.read_bytes().endswith(b"\n"):
            self._file.write("\n")  # end a line torn by a killed run; reading skips it

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class BatchSummary:
    """What one run did. `skipped`: ids already answered by an earlier run."""

    answered: int = 0
    failed: int = 0
    skipped: int = 0
    malformed: int = 0
    duplicates: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    problems: list[InputProblem] = field(default_factory=list)

    def line(self) -> str:
        rate = self.answered / self.seconds if self.seconds > 0 else 0.0
        return (
            f"answered={self.answered} failed={self.failed} skipped={self.skipped} "
            f"malformed={self.malformed} duplicates={self.duplicates} "
            f"cache_hits={self.cache_hits} seconds={self.seconds:.1f} questions_per_s={rate:.3f}"
        )


def error_record(ident: str, question: str, kind: str, message: str) -> dict[str, Any]:
    return {
        "id": ident,
        "status": "error",
        "question": question,
        "error": {"type": kind, "message": message},
    }


# --- merging the critique calls of one actor's decoder threads -----------------------------------


@dataclass
class _Entry:
    key: tuple[str, str, int | None]
    branches: list[Branch]
    drafts: list[Generation] | None
    since: float
    done: bool = False
    result: list[Any] | None = None
    error: BaseException | None = None


class CallMerger:
    """One engine call at a time for all decoder threads of an actor. A call waits until every
    running decoder has a call pending (or `max_wait_s` passed), then all pending calls with the
    oldest call's (method, critique source, max_tokens) run as one batch of branches."""

    def __init__(
        self, critic_for: Callable[[str], Critic], max_wait_s: float = MERGE_WAIT_S
    ) -> None:
        self._critic_for = critic_for
        self._max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._pending: list[_Entry] = []
        self._busy = False
        self._active = 0
        self.engine_calls = 0
        self.merged_branches = 0

    def enter(self) -> None:
        with self._cond:
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()  # the others may be waiting for this decoder

    def call(
        self,
        method: str,
        source: str,
        branches: Sequence[Branch],
        drafts: Sequence[Generation] | None = None,
        max_tokens: int | None = None,
    ) -> list[Any]:
        entry = _Entry(
            (method, source, max_tokens),
            list(branches),
            list(drafts) if drafts is not None else None,
            time.monotonic(),
        )
        with self._cond:
            self._pending.append(entry)
            self._cond.notify_all()
        while True:
            with self._cond:
                group = self._wait_for_turn(entry)
            if group is None:
                break
            self._execute(group)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        if entry.error is not None:
            raise entry.error
        assert entry.result is not None
        return entry.result

    def _wait_for_turn(self, entry: _Entry) -> list[_Entry] | None:
        """Under the lock: None once `entry` is done, else the group this thread must run."""
        while not entry.done:
            if not self._busy and self._pending:
                waited = time.monotonic() - self._pending[0].since
                if len(self._pending) >= self._active or waited >= self._max_wait_s:
                    key = self._pending[0].key
                    group = [e for e in self._pending if e.key == key]
                    self._pending = [e for e in self._pending if e.key != key]
                    self._busy = True
                    return group
                self._cond.wait(self._max_wait_s - waited)
            else:
                self._cond.wait()
        return None

    def _execute(self, group: list[_Entry]) -> None:
        try:
            outputs = self._engine_call(group)
        except Exception:
            if len(group) == 1:
                group[0].error = sys.exc_info()[1]
                group[0].done = True
                return
            # One bad request must not fail its neighbours: run each alone.
            for e in group:
                self._execute([e])
            return
        start = 0
        for e in group:
            e.result = outputs[start : start + len(e.branches)]
            e.done = True
            start += len(e.branches)

    def _engine_call(self, group: list[_Entry]) -> list[Any]:
        method, source, max_tokens = group[0].key
        critic = self._critic_for(source)
        branches = [b for e in group for b in e.branches]
        self.engine_calls += 1
        self.merged_branches += len(branches)
        if method == "draft":
            assert max_tokens is not None
            return critic.draft(branches, max_tokens)
        if method in ("support", "utility"):
            drafts = [d for e in group for d in (e.drafts or [])]
            return list(getattr(critic, method)(branches, drafts))
        return list(getattr(critic, method)(branches))


class MergedCritic:
    """The `Critic` one decoder thread sees: its calls go through the actor's `CallMerger`."""

    def __init__(self, merger: CallMerger, source: str, name: str, cancel: threading.Event) -> None:
        self._merger = merger
        self._source = source
        self._cancel = cancel
        self.name = name

    def _call(self, method: str, branches: Sequence[Branch], *rest: Any) -> list[Any]:
        if self._cancel.is_set():
            raise Cancelled
        if not branches:
            return []
        return self._merger.call(method, self._source, branches, *rest)

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        return self._call("retrieval", branches)

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        return self._call("relevance", branches)

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        return self._call("draft", branches, None, max_tokens)

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        return self._call("support", branches, drafts)

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        return self._call("utility", branches, drafts)


# --- Ray actors ----------------------------------------------------------------------------------


class RetrieverActor:
    """The one owner of an embedded Qdrant folder (and its embedder) for all engine actors."""

    def __init__(self, settings: Settings) -> None:
        from infra.runtime import SelfRAG

        self._rag = SelfRAG(settings)
        self._store = self._rag.store
        self._store.search("warm up", 1)  # load the embedder now, not on the first question

    def search(self, query: str, k: int) -> list[Passage]:
        return self._store.search(query, k)

    def index_version(self) -> str:
        return self._store.index_version()

    def count(self) -> int:
        return self._store.count()

    def close(self) -> None:
        self._rag.close()


class _RemoteStore:
    """`pipeline.protocols.Retriever` through a `RetrieverActor` handle."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def search(self, query: str, k: int) -> list[Passage]:
        import ray

        return ray.get(self._handle.search.remote(query, k))  # type: ignore[no-any-return]

    def index_version(self) -> str:
        import ray

        return ray.get(self._handle.index_version.remote())  # type: ignore[no-any-return]


class BatchAnswerer:
    """A Ray Data actor: one llama.cpp engine, and a thread per question of a batch."""

    def __init__(self, settings: Settings, retriever: Any | None, n_threads: int) -> None:
        from infra.cache import open_query_cache
        from infra.runtime import SelfRAG

        if n_threads and not settings.model.n_threads:
            model = settings.model.model_copy(update={"n_threads": n_threads})
            settings = settings.model_copy(update={"model": model})
        self._settings = settings
        self._rag = SelfRAG(settings)
        self._model_id = self._rag.engine.model_id  # load now, in this actor's process
        self._store: Any = _RemoteStore(retriever) if retriever is not None else self._rag.store
        self._index_version = self._store.index_version()
        self._cache = open_query_cache(settings)
        self._merger = CallMerger(self._rag.critic)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        keys = [str(k) for k in batch["key"]]
        questions = [str(q) for q in batch["question"]]
        configs = [DecodingConfig.model_validate_json(str(c)) for c in batch["config"]]
        with ThreadPoolExecutor(len(keys), thread_name_prefix="selfrag-batch") as pool:
            results = list(pool.map(self._answer_one, questions, configs))
        return {"key": keys, "result": results}

    def _answer_one(self, question: str, config: DecodingConfig) -> str:
        """The outcome of one question as JSON: {status: ok, response, cache} or
        {status: error, error: {type, message}}."""
        from actors.service import query_key

        key = query_key(question, config, self._index_version, self._model_id)
        if self._cache is not None:
            hit = self._cache.get(key)
            if hit is not None:
                return _ok(hit, "hit")
        cancel = threading.Event()
        timer = threading.Timer(config.timeout_s, cancel.set)
        timer.start()
        self._merger.enter()
        try:
            critic = self._rag.critic(config.critique)  # validates the source up front
            name = critic.name
            decoder = SelfRAGDecoder(
                lambda source: MergedCritic(self._merger, source, name, cancel),
                self._store,
                self._model_id,
            )
            response = decoder.answer(question, config)
        except Cancelled:
            return _error("timeout", f"no answer within timeout_s={config.timeout_s:g}")
        except Exception as exc:  # any failure is this question's record, not the run's end
            kind = "invalid" if isinstance(exc, ValueError) else "model_error"
            return _error(kind, f"{type(exc).__name__}: {exc}")
        finally:
            self._merger.leave()
            timer.cancel()
        if self._cache is not None:
            self._cache.put(key, response)
        return _ok(response, "miss")


def _ok(response: AnswerResponse, cache: str) -> str:
    body = response.model_dump(mode="json")
    return json.dumps({"status": "ok", "cache": cache, "response": body})


def _error(kind: str, message: str) -> str:
    return json.dumps({"status": "error", "error": {"type": kind, "message": message}})


# --- the driver ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """One distinct (question, effective config): answered once for all its ids."""

    key: str
    question: str
    config: DecodingConfig
    ids: list[str]


def plan_jobs(
    questions: Iterable[BatchQuestion], defaults: DecodingConfig
) -> tuple[list[_Job], list[dict[str, Any]]]:
    """Distinct jobs of the valid requests, and an error record for each invalid one."""
    from actors.service import query_key

    jobs: dict[str, _Job] = {}
    errors: list[dict[str, Any]] = []
    for q in questions:
        try:
            request = AnswerRequest.model_validate({"question": q.question, "config": q.config})
        except ValidationError as exc:
            from infra.settings import describe_validation_error

            errors.append(error_record(q.id, q.question, "invalid", describe_validation_error(exc)))
            continue
        config = request.config.apply_to(defaults)
        # Index version and model are the same for the whole run, so they can stay out here.
        key = query_key(request.question, config, "", "")
        if key in jobs:
            jobs[key].ids.append(q.id)
        else:
            jobs[key] = _Job(key, request.question, config, [q.id])
    return list(jobs.values()), errors


@dataclass(frozen=True)
class Resources:
    """How the actor pool is sized."""

    actors: int
    actor_cpus: float
    n_threads: int
    per_actor: int


def plan_resources(
    total_cpus: float, actors: int | None, per_actor: int, n_threads: int
) -> Resources:
    """Default: one actor per available CPU, each with one llama.cpp thread, leaving a share
    for the retriever; `actors` overrides the count, and the CPUs are split between them."""
    usable = max(total_cpus - RETRIEVER_CPUS, 0.1)
    count = actors if actors is not None else max(1, int(usable))
    cpus = max(0.05, math.floor(usable / count * 20) / 20)
    threads = n_threads or max(1, round(cpus))
    return Resources(count, cpus, threads, per_actor)


def ensure_ray(address: str | None) -> bool:
    """Connect to `address` or start a private local instance (unless Ray already runs in this
    process). True when this call started Ray, so the caller shuts it down."""
    import ray

    if ray.is_initialized():
        return False
    if address is None:
        # A private single-machine instance: ports on loopback, no cluster token.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    return True


def stream_answers(
    settings: Settings,
    jobs: Sequence[_Job],
    *,
    actors: int | None = None,
    per_actor: int = 8,
    actor_cpus: float | None = None,
) -> Iterator[tuple[_Job, dict[str, Any]]]:
    """Answer `jobs` on Ray Data (Ray must be initialised); yields (job, outcome) as each
    batch completes, in completion order."""
    import ray

    if not jobs:
        return
    plan = plan_resources(
        ray.available_resources().get("CPU", 1.0), actors, per_actor, settings.model.n_threads
    )
    if actor_cpus is not None:
        plan = Resources(plan.actors, actor_cpus, plan.n_threads, per_actor)
    # Settings travel pickled: their secrets (qdrant_api_key, redis_url) stay secret types,
    # masked in any repr or log; a JSON dump would replace them by the mask for good.
    retriever = None
    if not settings.retrieval.qdrant_url:
        retriever = (
            ray.remote(RetrieverActor)
            .options(num_cpus=min(RETRIEVER_CPUS, plan.actor_cpus))
            .remote(settings)
        )
    by_key = {j.key: j for j in jobs}
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False  # the driver draws its own, per question
    ctx.execution_options.preserve_order = False
    rows = [
        {"key": j.key, "question": j.question, "config": j.config.model_dump_json()} for j in jobs
    ]
    # One block per batch and whole blocks as batches (batch_size=None): each batch is its own
    # task, so results stream back batch by batch instead of a task per several batches.
    blocks = max(1, math.ceil(len(rows) / per_actor))
    ds = ray.data.from_items(rows, override_num_blocks=blocks).map_batches(
        BatchAnswerer,
        fn_constructor_kwargs={
            "settings": settings,
            "retriever": retriever,
            "n_threads": plan.n_threads,
        },
        batch_size=None,
        compute=ray.data.ActorPoolStrategy(size=plan.actors),
        num_cpus=plan.actor_cpus,
        batch_format="numpy",
        max_concurrency=1,
    )
    iterator = ds.iter_rows()
    try:
        for row in iterator:
            yield by_key[str(row["key"])], json.loads(str(row["result"]))
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
        if retriever is not None:
            # Release the folder lock before returning: ray.kill alone is asynchronous, and the
            # next user of the embedded store (a rerun, eval's baselines) would find it locked.
            try:
                ray.get(retriever.close.remote(), timeout=30)
            finally:
                ray.kill(retriever)


def run_batch(
    settings: Settings,
    source: Path,
    out: Path,
    *,
    actors: int | None = None,
    per_actor: int = 8,
    limit: int | None = None,
    shard: tuple[int, int] | None = None,
    address: str | None = None,
    progress: bool = True,
    actor_cpus: float | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> BatchSummary:
    """Answer every question of `source` not yet in `out`, appending one record per id.
    `on_record` sees each record right after it is written."""
    started = time.perf_counter()
    questions, problems = read_questions(source)
    summary = BatchSummary(malformed=len(problems), problems=problems)
    for p in problems:
        print(f"selfrag batch: {source}:{p.line}: {p.reason}", file=sys.stderr)
    chosen = select(questions, limit, shard)
    done = done_ids(out)
    todo = [q for q in chosen if q.id not in done]
    summary.skipped = len(chosen) - len(todo)
    jobs, invalid = plan_jobs(todo, settings.decoding)
    sink = RecordSink(out)
    bar = tqdm(
        total=len(todo),
        desc="batch",
        unit="q",
        file=sys.stderr,
        disable=not progress,
        smoothing=0.1,
    )

    def emit(record: dict[str, Any]) -> None:
        sink.write(record)
        bar.update(1)
        if on_record is not None:
            on_record(record)

    started_ray = False
    try:
        for record in invalid:
            summary.failed += 1
            emit(record)
        if jobs:
            started_ray = ensure_ray(address)
            for job, outcome in stream_answers(
                settings, jobs, actors=actors, per_actor=per_actor, actor_cpus=actor_cpus
            ):
                summary.duplicates += len(job.ids) - 1
                for n, ident in enumerate(job.ids):
                    if outcome["status"] == "ok":
                        summary.answered += 1
                        if outcome["cache"] == "hit" or n > 0:
                            summary.cache_hits += 1
                        record = {
                            "id": ident,
                            "status": "ok",
                            "question": job.question,
                            "response": outcome["response"],
                        }
                        if n > 0:
                            record["duplicate_of"] = job.ids[0]
                    else:
                        summary.failed += 1
                        record = {
                            "id": ident,
                            "status": "error",
                            "question": job.question,
                            "error": outcome["error"],
                        }
                    emit(record)
    finally:
        bar.close()
        sink.close()
        if started_ray:
            import ray

            ray.shutdown()
    summary.seconds = time.perf_counter() - started
    return summary


def run_eval_systems(
    settings: Settings,
    questions: Sequence[Any],
    systems: Sequence[str],
    out: Path,
    config: DecodingConfig,
    *,
    actors: int | None = None,
    progress: bool = True,
    address: str | None = None,
) -> None:
    """`selfrag eval --ray`: answer the selfrag-* systems' missing records on the batch path,
    appending them to `out/records.jsonl` (`run_evaluation` then skips them and writes the
    report). `questions` are `infra.evaluation.EvalQuestion`. p_ret is the first segment's
    (no extra probe), and latency is the decoder's own total time, batched with others."""
    from actors.service import query_key
    from infra.evaluation import RECORDS_FILE, make_record, read_records

    path = out / RECORDS_FILE
    out.mkdir(parents=True, exist_ok=True)
    done = {(r["system"], r["id"]) for r in read_records(path)}
    jobs: dict[str, _Job] = {}
    owners: dict[str, list[tuple[str, Any]]] = {}
    for system in systems:
        if not system.startswith("selfrag-"):
            continue  # the baselines stay in-process
        cfg = config.model_copy(update={"critique": system.removeprefix("selfrag-")})
        for q in questions:
            if (system, q.id) in done:
                continue
            key = query_key(q.question, cfg, "", "")
            jobs.setdefault(key, _Job(key, q.question, cfg, []))
            owners.setdefault(key, []).append((system, q))
    if not jobs:
        return
    sink = RecordSink(path)
    bar = tqdm(
        total=sum(len(v) for v in owners.values()),
        desc="eval (ray)",
        unit="answer",
        file=sys.stderr,
        disable=not progress,
    )
    started_ray = ensure_ray(address)
    try:
        for job, outcome in stream_answers(settings, list(jobs.values()), actors=actors):
            for system, q in owners[job.key]:
                bar.update(1)
                if outcome["status"] != "ok":
                    # Left without a record: run_evaluation answers it in-process.
                    print(
                        f"eval --ray: {system} {q.id}: {outcome['error']['message']}",
                        file=sys.stderr,
                    )
                    continue
                r = AnswerResponse.model_validate(outcome["response"])
                p_ret = r.segments[0].p_ret if r.segments else None
                sink.write(make_record(system, q, r, p_ret, 0, r.timings_ms.get("total", 0.0)))
    finally:
        bar.close()
        sink.close()
        if started_ray:
            import ray

            ray.shutdown()
