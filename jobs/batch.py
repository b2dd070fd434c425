"""`selfrag batch`: answer a file of questions on Ray Data, with nothing lost.

* Input: JSONL `{id?, question, config?}`, CSV (columns `id?`, `question`, `config?` as JSON) or
  Parquet (same columns). A row without an id gets its line (JSONL/CSV) or row number. A row
  that cannot be read (not UTF-8, not JSON, no question, a CSV field over the csv module's
  limit, a line over `MAX_LINE_BYTES`) becomes an error record of type `malformed` under its
  own id when that could be read, else its line number; a repeated id is reported only (the
  first row with the id owns its record).
* One run per output file: `lock_output` holds `<out>.lock` (flock) for the run, and a second
  run on the same `--out` is refused.
* The driver drops ids already in the output file (resume; with `retry_failed`, ids whose last
  record is an error are answered again), writes an error record for every request that does
  not validate, and answers each distinct (question, effective config) once
  (`runtime.answering.query_key`); every id of a duplicate gets the same answer.
* Ray Data runs `BatchAnswerer`, a pool of actors each owning one llama.cpp engine. An actor
  decodes a batch of questions in threads; `CallMerger` turns their per-step critique calls
  into one multi-sequence engine call, the way `BranchPool` merges concurrent HTTP requests.
* Embedded Qdrant allows one client per folder, so with it a single `RetrieverActor` owns the
  store (and the embedder) and the engine actors search through it; with `qdrant_url` set each
  actor opens its own client.
* The driver appends one JSON line per record and flushes it as results stream back, so a
  killed run loses at most the batches in flight, and the same command resumes it. The last
  record of an id is the one that counts; a run that finishes rewrites the file (atomically)
  without the records a later record of the same id replaced, leaving one record per id.
* On a cluster the driver watches the nodes while the Dataset runs: when a node goes (its
  raylet killed, its machine gone), Ray Data restarts that node's engine actors elsewhere if
  the pool still fits the nodes left, and the run finishes there; if it does not fit, the run
  stops within seconds of Ray declaring the node dead (`NodeLost`) instead of waiting for ever
  for actors that cannot start, and the same command answers the rest.
"""

from __future__ import annotations

import codecs
import csv
import fcntl
import json
import logging
import math
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from tqdm import tqdm

from selfrag.infra.corpus import JSONInputError, load_json, read_lines
from selfrag.infra.engine_threads import ray_runtime_env
from selfrag.pipeline.critics import unresolved_filters
from selfrag.pipeline.decoder import SelfRAGDecoder, StepListener
from selfrag.pipeline.protocols import Passage
from selfrag.runtime.answering import (
    AnswerPath,
    CacheIdentity,
    Deadline,
    query_cache_scope,
    query_key,
)
from selfrag.runtime.merging import CallMerger, MergedCritic
from selfrag.runtime.ray_cluster import init_ray
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import AnswerError
from selfrag.schemas.records import BatchRecord, RecordError, RecordErrorType
from selfrag.schemas.settings import Settings

log = logging.getLogger(__name__)

# Seconds a critique call waits for the other decoder threads of its actor before it runs
# alone. The threads' searches queue at one retriever (~0.1 s each on a loaded 2-core box),
# while a merged engine call takes seconds, so waiting for stragglers pays.
MERGE_WAIT_S = 0.3
RETRIEVER_CPUS = 0.1
# Seconds a pool that fits the cluster waits for CPUs still held by actors going away.
RESOURCE_WAIT_S = 10.0
# How often the driver asks the cluster which nodes are alive while a batch runs (two small
# GCS calls); Ray itself takes ~15 s of missed health checks to declare a node dead.
NODE_CHECK_S = 2.0
# A question is at most 2000 characters and its config a few fields: a JSONL line past this is
# not a request, and is skipped without being read whole.
MAX_LINE_BYTES = 1 << 20
# A row is `{id, question, config: {dial: value}}`: nesting past this is not a request, and is
# refused before anything walks it recursively.
MAX_ROW_DEPTH = 32
# Parquet rows read at a time: memory follows this and MAX_LINE_BYTES, not the file.
PARQUET_BATCH_ROWS = 256
# What `surrogateescape` turns an undecodable byte into: such a CSV field was not UTF-8.
_UNDECODABLE = re.compile("[\udc80-\udcff]")
_T = TypeVar("_T")


class BatchInputError(ValueError):
    """The input file cannot be read at all (missing, unknown format)."""


class OutputLockedError(OSError):
    """Another run holds the output file's lock."""


@dataclass(frozen=True)
class BatchQuestion:
    """One input row: its id, the question, its config overrides and where it came from."""

    id: str
    question: str
    config: dict[str, Any]
    line: int


@dataclass(frozen=True)
class InputProblem:
    """A row that could not be read, with its line (or row) number. `id` is the id of its error
    record: the row's own id when that could be read, else its line number; None for a row
    that repeats an id (the first row with that id owns the record)."""

    line: int
    reason: str
    id: str | None = None


@dataclass(frozen=True)
class _Unreadable:
    """A row reader's verdict on a row it could not turn into fields; `raw_id` when salvaged."""

    reason: str
    raw_id: Any = None


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
        q: BatchQuestion | None = None
        if isinstance(row, _Unreadable):
            ident, reason = _ident(line, row.raw_id), row.reason
        else:
            try:
                q = _question(line, row)
                ident, reason = q.id, ""
            except ValueError as exc:
                ident, reason = _ident(line, row.get("id")), str(exc)
        if ident in first_line:
            duplicate = f"duplicate id {ident!r} (first at line {first_line[ident]})"
            problems.append(InputProblem(line, duplicate))
            continue
        first_line[ident] = line
        if q is None:
            problems.append(InputProblem(line, reason, ident))
        else:
            questions.append(q)
    return questions, problems


def _ident(line: int, raw_id: Any) -> str:
    return str(line) if raw_id is None or raw_id == "" else str(raw_id)


def _question(line: int, row: dict[str, Any]) -> BatchQuestion:
    question = row.get("question")
    if not isinstance(question, str):
        raise ValueError("no 'question' string")
    ident = _ident(line, row.get("id"))
    config = row.get("config")
    if config is None or config == "":
        config = {}
    elif isinstance(config, str):
        try:
            config = load_json(config, MAX_ROW_DEPTH)
        except JSONInputError as exc:
            why = f"is not JSON: {exc}" if exc.line is not None else f"has {exc}"
            raise ValueError(f"'config' {why}") from None
    if not isinstance(config, dict):
        raise ValueError("'config' must be an object")
    return BatchQuestion(ident, question, config, line)


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | _Unreadable]]:
    # Bytes and bounded lines: a bad byte or a runaway line costs that line, not the run.
    with path.open("rb") as f:
        for line in read_lines(f, MAX_LINE_BYTES):
            n, data = line.number, line.data
            if data is None:
                yield n, _Unreadable(f"line too long ({line.size} bytes, limit {MAX_LINE_BYTES})")
                continue
            if n == 1:
                data = data.removeprefix(codecs.BOM_UTF8)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                reason = f"not UTF-8 ({exc.reason} at byte {exc.start} of the line)"
                yield n, _Unreadable(reason, _salvage_id(data))
                continue
            if not text.strip():
                continue
            try:
                row = load_json(text, MAX_ROW_DEPTH)
            except JSONInputError as exc:
                why = f"not JSON: {exc}" if exc.line is not None else f"the row has {exc}"
                yield n, _Unreadable(why)
                continue
            yield n, row if isinstance(row, dict) else _Unreadable("not a JSON object")


def _salvage_id(data: bytes) -> str | int | None:
    """The id of a JSON line that is not UTF-8, when the bad bytes are not in the id itself."""
    try:
        row = load_json(data.decode("utf-8", errors="replace"), MAX_ROW_DEPTH)
    except JSONInputError:
        return None
    raw_id = row.get("id") if isinstance(row, dict) else None
    if isinstance(raw_id, str) and "\ufffd" not in raw_id:
        return raw_id
    if isinstance(raw_id, int) and not isinstance(raw_id, bool):
        return raw_id
    return None


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | _Unreadable]]:
    # surrogateescape: an undecodable byte becomes a marker in its field (found per row below)
    # instead of a UnicodeDecodeError that ends the whole read.
    with path.open(encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f)
        try:
            names = reader.fieldnames
        except csv.Error as exc:
            raise BatchInputError(f"{path}: unreadable CSV header: {_csv_reason(exc)}") from None
        if names is None or "question" not in names:
            raise BatchInputError(f"{path}: no 'question' column")
        if any(_UNDECODABLE.search(name) for name in names):
            raise BatchInputError(f"{path}: the CSV header is not UTF-8")
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                # The row is dropped and reading resumes at the next physical line; the inner
                # reader's count includes the line the error was found on.
                yield reader.reader.line_num, _Unreadable(_csv_reason(exc))
                continue
            # line_num is the physical line the row ended on; quoted newlines stay correct.
            raw_id = row.get("id")
            if isinstance(raw_id, str) and _UNDECODABLE.search(raw_id):
                raw_id = None
            if None in row:
                yield reader.line_num, _Unreadable("more fields than the header", raw_id)
                continue
            if any(isinstance(v, str) and _UNDECODABLE.search(v) for v in row.values()):
                yield reader.line_num, _Unreadable("not UTF-8", raw_id)
                continue
            yield reader.line_num, dict(row)


def _csv_reason(exc: csv.Error) -> str:
    if "field larger than field limit" in str(exc):
        return (
            f"a field is longer than the csv module's limit ({csv.field_size_limit()} "
            "characters); a question is at most 2000"
        )
    return f"not CSV: {exc}"


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | _Unreadable]]:
    # In batches of PARQUET_BATCH_ROWS, only the columns a row uses: memory follows the batch
    # (and Parquet's own unit, the row group), never the file.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise BatchInputError(f"{path}: not a readable Parquet file: {exc}") from None
    names = file.schema_arrow.names
    if "question" not in names:
        raise BatchInputError(f"{path}: no 'question' column")
    columns = [name for name in ("id", "question", "config") if name in names]
    n = 0
    try:
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            for i in range(batch.num_rows):
                n += 1
                row = batch.slice(i, 1)
                size = row.nbytes  # the bytes this row references, nested values included
                if size <= MAX_LINE_BYTES:
                    yield n, row.to_pylist()[0]
                    continue
                raw_id = row.column("id")[0].as_py() if "id" in columns else None
                if not isinstance(raw_id, int | str) or len(str(raw_id)) > 200:
                    raw_id = None
                reason = f"row too large ({size} bytes, limit {MAX_LINE_BYTES})"
                yield n, _Unreadable(reason, raw_id)
    except (pa.ArrowException, OSError) as exc:
        raise BatchInputError(f"{path}: unreadable Parquet after row {n}: {exc}") from None
    finally:
        file.close()


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


def select(rows: Sequence[_T], limit: int | None, shard: tuple[int, int] | None) -> list[_T]:
    """The rows this run owns: every n-th from the i-th (by input position), then the first
    `limit`. Depends only on the input, so a rerun selects the same rows."""
    chosen = list(rows)
    if shard is not None:
        i, n = shard
        chosen = chosen[i::n]
    return chosen[:limit] if limit is not None else chosen


# --- output --------------------------------------------------------------------------------------


def _record_id(line: bytes) -> str | None:
    """The id of one output line; None for a line torn by a killed run (or not a record)."""
    try:
        return str(load_json(line.decode("utf-8"))["id"])
    except (ValueError, KeyError, TypeError):  # ValueError: bad JSON or bad UTF-8
        return None


def last_statuses(path: Path) -> tuple[dict[str, str], int]:
    """The status of each id's last record in `path` (the last record of an id is the one
    that counts), and how many earlier records those replace."""
    statuses: dict[str, str] = {}
    records = 0
    if not path.exists():
        return statuses, 0
    with path.open("rb") as f:
        for line in f:
            try:
                record = load_json(line.decode("utf-8"))
                statuses[str(record["id"])] = str(record.get("status"))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn line, or not a record
            records += 1
    return statuses, records - len(statuses)


def earlier_answers(path: Path, keys: set[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """For each of `keys` answered by an ok record already in `path`: that record's id and
    response. A duplicate whose first id was answered by an earlier (killed) run reuses it."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    if not keys or not path.exists():
        return found
    with path.open("rb") as f:
        for line in f:
            try:
                record = load_json(line.decode("utf-8"))
                if record.get("status") != "ok":
                    continue
                response = record["response"]
                # The response holds the filters its critique resolved; the jobs' keys have
                # the request's (None for a default).
                config = unresolved_filters(
                    DecodingConfig.model_validate(response["config"]),
                    str(response.get("critique", "")),
                )
                key = query_key(str(record["question"]), config, "", "")
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn line, or not an answer record
            if key in keys:
                found[key] = (str(record["id"]), response)
    return found


def done_ids(path: Path, retry_failed: bool = False) -> set[str]:
    """Ids a run skips: those with a record in `path` (a torn last line is ignored), less
    those whose last record is an error when `retry_failed`."""
    statuses, _ = last_statuses(path)
    return {i for i, status in statuses.items() if not (retry_failed and status == "error")}


def compact_records(path: Path) -> int:
    """Rewrite `path` without the records that a later record of the same id replaces, in one
    atomic rename (a crash leaves the old file or the new one, never half of one). Every other
    line stays, in order. Returns the number of records dropped."""
    if not path.exists():
        return 0
    last: dict[str, int] = {}
    records = 0
    with path.open("rb") as f:
        for n, line in enumerate(f):
            ident = _record_id(line)
            if ident is not None:
                last[ident] = n
                records += 1
    if records == len(last):
        return 0  # one record per id already: nothing to rewrite
    dropped = 0
    tmp = path.with_name(path.name + ".compact")
    with path.open("rb") as src, tmp.open("wb") as dst:
        for n, line in enumerate(src):
            ident = _record_id(line)
            if ident is not None and last[ident] != n:
                dropped += 1
                continue
            dst.write(line)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)
    return dropped


@contextmanager
def lock_output(out: Path) -> Iterator[Path]:
    """Hold `<out>.lock` (flock) while writing `out`; raise OutputLockedError at once when
    another process holds it. The OS drops the lock when the holder exits, however it exits,
    so a killed run never leaves a stale lock. The lock file itself stays (removing it would
    race with a run that is opening it)."""
    lock = out.with_name(out.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            raise OutputLockedError(
                f"{out} is being written by another `selfrag batch` run"
                + (f" (pid {holder})" if holder.isdigit() else "")
                + f": it holds {lock}. Wait for it to finish, or write to another --out."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield lock
    finally:
        os.close(fd)  # releases the flock


class RecordSink:
    """Appends one JSON line per record and flushes it, so a crash loses nothing written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        if self._file.tell():
            with path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            if torn:
                self._file.write("\n")  # end a line torn by a killed run; reading skips it

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class BatchSummary:
    """What one run did. `skipped`: ids already answered by an earlier run; `retried`: ids
    answered again because their last record was an error (`retry_failed`); `malformed`: rows
    that could not be read, reported with their line, and repeated ids."""

    answered: int = 0
    failed: int = 0
    skipped: int = 0
    retried: int = 0
    malformed: int = 0
    duplicates: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    problems: list[InputProblem] = field(default_factory=list)

    def line(self) -> str:
        rate = self.answered / self.seconds if self.seconds > 0 else 0.0
        return (
            f"answered={self.answered} failed={self.failed} skipped={self.skipped} "
            f"retried={self.retried} malformed={self.malformed} duplicates={self.duplicates} "
            f"cache_hits={self.cache_hits} seconds={self.seconds:.1f} questions_per_s={rate:.3f}"
        )


def error_record(
    ident: str, question: str | None, kind: RecordErrorType, message: str
) -> dict[str, Any]:
    error = RecordError(type=kind, message=message)
    return BatchRecord(id=ident, status="error", question=question, error=error).to_json()


def ok_record(
    ident: str, question: str, response: dict[str, Any], duplicate_of: str | None = None
) -> dict[str, Any]:
    extra = {"duplicate_of": duplicate_of} if duplicate_of is not None else {}
    return BatchRecord(
        id=ident, status="ok", question=question, response=response, **extra
    ).to_json()


def malformed_record(problem: InputProblem) -> dict[str, Any]:
    """The error record of a row that could not be read (its question is unknown)."""
    assert problem.id is not None
    error = RecordError(type="malformed", message=problem.reason)
    return BatchRecord(
        id=problem.id, status="error", question=None, error=error, line=problem.line
    ).to_json()


# --- Ray actors ----------------------------------------------------------------------------------


class RetrieverActor:
    """The one owner of an embedded Qdrant folder (and its embedder) for all engine actors."""

    def __init__(self, settings: Settings) -> None:
        from selfrag.runtime.system import SelfRAGSystem

        self._rag = SelfRAGSystem(settings)
        self._store = self._rag.store
        self._store.search("warm up", 1)  # load the embedder now, not on the first question

    def search(self, query: str, k: int) -> list[Passage]:
        return self._store.search(query, k)

    def search_many(self, queries: list[str], k: int) -> list[list[Passage]]:
        return self._store.search_many(queries, k)

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

    def search_many(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        import ray

        return ray.get(self._handle.search_many.remote(list(queries), k))  # type: ignore[no-any-return]

    def index_version(self) -> str:
        import ray

        return ray.get(self._handle.index_version.remote())  # type: ignore[no-any-return]


class BatchAnswerer:
    """A Ray Data actor: one llama.cpp engine, and a thread per question of a batch."""

    def __init__(self, settings: Settings, retriever: Any | None, n_threads: int) -> None:
        from selfrag.infra.cache import open_query_cache
        from selfrag.runtime.system import SelfRAGSystem

        if n_threads and not settings.model.n_threads:
            model = settings.model.model_copy(update={"n_threads": n_threads})
            settings = settings.model_copy(update={"model": model})
        self._settings = settings
        self._rag = SelfRAGSystem(settings)
        self._model_id = self._rag.engine.model_id  # load now, in this actor's process
        self._store: Any = _RemoteStore(retriever) if retriever is not None else self._rag.store
        self._index_version = self._store.index_version()
        # The key the online endpoint uses too: a Redis shared with it serves both.
        self._path = AnswerPath(
            settings.decoding,
            cache=open_query_cache(settings),
            cache_scope=query_cache_scope(settings),
        )
        self._merger = CallMerger(self._rag.critic, MERGE_WAIT_S)

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
        try:
            answer = self._path.answer(question, config, self._decode, identity=self._identity)
        except AnswerError as exc:
            return _error(exc.kind, exc.detail)
        except Exception as exc:  # any failure is this question's record, not the run's end
            return _error("internal_error", f"{type(exc).__name__}: {exc}")
        return _ok(answer.response, answer.cache)

    def _identity(self) -> CacheIdentity:
        # Hashes the model file once per actor, and only when answers are cached.
        return CacheIdentity(self._index_version, self._rag.model_fingerprint)

    def _decode(
        self,
        question: str,
        config: DecodingConfig,
        deadline: Deadline,
        on_step: StepListener | None,
    ) -> AnswerResponse:
        critic = self._rag.critic(config.critique)  # validates the source up front
        name = critic.name
        decoder = SelfRAGDecoder(
            lambda source: MergedCritic(self._merger, source, name, deadline),
            self._store,
            self._model_id,
        )
        self._merger.enter()
        try:
            return decoder.answer(question, config, on_step)
        finally:
            self._merger.leave()


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
    jobs: dict[str, _Job] = {}
    errors: list[dict[str, Any]] = []
    for q in questions:
        try:
            request = AnswerRequest.model_validate({"question": q.question, "config": q.config})
        except ValidationError as exc:
            from selfrag.infra.settings import describe_validation_error

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


class NodeLost(ConnectionError):
    """A node left the cluster mid-run and the engine pool no longer fits the nodes left: Ray
    Data would wait for ever for the actors it restarts."""


class ClusterTooSmall(ValueError):
    """The engine actors asked for do not fit the nodes of the cluster: Ray would queue them,
    and the job would wait for resources that never come."""


@dataclass(frozen=True)
class NodeCPUs:
    """One alive node's free CPUs, as the planner sees them."""

    node_id: str
    cpus: float
    driver: bool = False


def _fits(nodes: Sequence[NodeCPUs], cpus: float, reserve: float) -> int:
    """How many actors of `cpus` each the nodes hold, `reserve` kept on the driver's node."""
    eps = 1e-9
    return sum(int((n.cpus - (reserve if n.driver else 0.0) + eps) // cpus) for n in nodes)


def _describe(nodes: Sequence[NodeCPUs]) -> str:
    mark = " (the driver's)"
    each = ", ".join(f"{n.node_id[:8]}{mark if n.driver else ''} {n.cpus:g}" for n in nodes)
    plural = "s" if len(nodes) != 1 else ""
    return f"the cluster has {len(nodes)} node{plural} with CPUs free: {each}"


def plan_resources(
    total_cpus: float | Sequence[NodeCPUs],
    actors: int | None,
    per_actor: int,
    n_threads: int,
    actor_cpus: float | None = None,
    reserve: float = RETRIEVER_CPUS,
) -> Resources:
    """Size the engine actor pool to the nodes: an actor runs on one node, so its CPUs must
    fit one node's free CPUs, not the cluster's sum. `total_cpus` is the free CPUs of each
    alive node (a number: one node, the driver's). `reserve`: the retriever's share, kept on
    the driver's node (0 with a Qdrant server).

    Default: one actor per free CPU of each node (at least one per node with a share to
    give), all of the size that fits the smallest of those shares; `actors` fixes the count
    and the size is the largest that fits them all; `actor_cpus` fixes the size. Raises
    ClusterTooSmall, naming what was asked for and what the nodes have, when they do not fit.
    """
    nodes = (
        [NodeCPUs("local", float(total_cpus), True)]
        if isinstance(total_cpus, int | float)
        else list(total_cpus)
    )
    usable = [n.cpus - (reserve if n.driver else 0.0) for n in nodes]
    if actor_cpus is None:
        if actors is None:
            shares = [u / max(1, int(u)) for u in usable if u >= 0.1]
            cpus = math.floor(min(shares, default=0.0) * 20) / 20
        else:
            # The largest size of 0.05 steps at which `actors` fit: one of u / m per node.
            sizes = sorted(
                {math.floor(u / m * 20) / 20 for u in usable for m in range(1, actors + 1)},
                reverse=True,
            )
            cpus = next((c for c in sizes if c >= 0.05 and _fits(nodes, c, reserve) >= actors), 0.0)
    else:
        cpus = actor_cpus
    count = actors if actors is not None else (_fits(nodes, cpus, reserve) if cpus > 0 else 0)
    if cpus <= 0 or count < 1 or _fits(nodes, cpus, reserve) < count:
        asked = f"{actors} engine actors" if actors is not None else "engine actors"
        size = f" of {cpus:g} CPU each" if cpus > 0 else ""
        extra = f", and {reserve:g} CPU for the retriever on the driver's node" if reserve else ""
        raise ClusterTooSmall(
            f"asked for {asked}{size}{extra}; {_describe(nodes)}. An actor runs on one node. "
            "Ask for fewer actors (--actors) or smaller ones (--actor-cpus), or add nodes"
        )
    threads = n_threads or max(1, round(cpus))
    return Resources(count, cpus, threads, per_actor)


def cluster_cpus(total: bool = False) -> list[NodeCPUs]:
    """The free CPUs (`total`: all CPUs) of each alive node of the Ray this process is
    connected to, the driver's node marked."""
    import ray
    from ray._private import state  # Ray is pinned: the per-node view its autoscaler uses

    here = ray.get_runtime_context().get_node_id()
    per_node = state.total_resources_per_node() if total else state.available_resources_per_node()
    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    return [NodeCPUs(i, float(per_node.get(i, {}).get("CPU", 0.0)), i == here) for i in alive]


def plan_on_cluster(
    actors: int | None,
    per_actor: int,
    n_threads: int,
    actor_cpus: float | None,
    reserve: float,
    wait_s: float = RESOURCE_WAIT_S,
) -> Resources:
    """`plan_resources` on the connected cluster's free CPUs. When the pool fits the nodes'
    CPUs but not what is free now (a previous job's actors are still going away), it tries
    again for up to `wait_s`; a pool that fits no node of the cluster fails at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return plan_resources(cluster_cpus(), actors, per_actor, n_threads, actor_cpus, reserve)
        except ClusterTooSmall as exc:
            try:
                plan_resources(
                    cluster_cpus(True), actors, per_actor, n_threads, actor_cpus, reserve
                )
            except ClusterTooSmall:
                raise exc from None  # too small even when idle: waiting cannot help
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def ensure_ray(address: str | None) -> bool:
    """Connect to `address` or start a private local instance (unless Ray already runs in this
    process; `runtime.ray_cluster.init_ray`). True when this call started a private instance,
    so the caller shuts it down."""
    return init_ray(address, log_to_driver=False)


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
    embedded = not settings.retrieval.qdrant_url
    # Checked before anything starts: actors that fit no node would wait silently for ever.
    plan = plan_on_cluster(
        actors,
        per_actor,
        settings.model.n_threads,
        actor_cpus,
        reserve=RETRIEVER_CPUS if embedded else 0.0,
    )
    # Settings travel pickled: their secrets (qdrant_api_key, redis_url) stay secret types,
    # masked in any repr or log; a JSON dump would replace them by the mask for good.
    retriever = None
    if embedded:
        # The embedded store is a folder on the driver's machine, owned by one process: on a
        # cluster the retriever must run on the driver's node, never elsewhere.
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        retriever = (
            ray.remote(RetrieverActor)
            .options(
                num_cpus=RETRIEVER_CPUS,
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
                **ray_runtime_env(settings.model),
            )
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
        # OMP_WAIT_POLICY in each actor's process from its start (infra.engine_threads).
        **ray_runtime_env(settings.model),
    )
    watch = NodeWatch(plan, RETRIEVER_CPUS if embedded else 0.0)
    try:
        for row in _rows_watched(ds, watch):
            yield by_key[str(row["key"])], json.loads(str(row["result"]))
    except NodeLost:
        # The abandoned Dataset's executor thread logs tracebacks of its own as the driver
        # disconnects; NodeLost's message says what happened, once.
        logging.getLogger("ray.data").setLevel(logging.CRITICAL)
        raise
    finally:
        if retriever is not None:
            # Release the folder lock before returning: ray.kill alone is asynchronous, and the
            # next user of the embedded store (a rerun, eval's baselines) would find it locked.
            try:
                ray.get(retriever.close.remote(), timeout=30)
            finally:
                ray.kill(retriever)


class NodeWatch:
    """The nodes alive when the pool started; `check` raises NodeLost once one of them is gone
    and the pool (`plan`, `reserve` CPUs on the driver's node) no longer fits the nodes left.
    A pool that still fits is left to Ray Data, which restarts the lost actors there.
    `nodes`: the alive nodes with their total CPUs (default: the connected cluster's)."""

    def __init__(
        self,
        plan: Resources,
        reserve: float,
        nodes: Callable[[], list[NodeCPUs]] | None = None,
    ) -> None:
        self._plan = plan
        self._reserve = reserve
        self._nodes = nodes or (lambda: cluster_cpus(total=True))
        self._start = {n.node_id for n in self._nodes()}
        self._told: set[str] = set()

    def check(self) -> None:
        left = self._nodes()
        lost = sorted(self._start - {n.node_id for n in left})
        if not lost:
            return
        names = ", ".join(n[:8] for n in lost)
        plan = self._plan
        if _fits(left, plan.actor_cpus, self._reserve) >= plan.actors:
            if set(lost) - self._told:
                log.warning(
                    "node %s left the cluster; its engine actors restart on the others", names
                )
                self._told |= set(lost)
            return
        plural = "s" if len(lost) > 1 else ""
        each = ", ".join(f"{n.node_id[:8]} {n.cpus:g} CPU" for n in left) or "none"
        raise NodeLost(
            f"node{plural} {names} left the cluster mid-run, and the {plan.actors} engine "
            f"actors of {plan.actor_cpus:g} CPU each no longer fit the nodes left ({each})"
        )


_END = object()


def _rows_watched(ds: Any, watch: NodeWatch, every_s: float = NODE_CHECK_S) -> Iterator[Any]:
    """`ds.iter_rows()`, read in a thread of its own so that `watch.check` runs every `every_s`
    even while no row comes (Ray Data blocks until one does). An error of the iteration is
    raised here; leaving early (NodeLost, or the caller stopping) stops the reader at its next
    row and closes Ray Data's iterator there."""
    rows: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()

    def read() -> None:
        iterator = ds.iter_rows()
        try:
            for row in iterator:
                rows.put(row)
                if stop.is_set():
                    break
            rows.put(_END)
        except BaseException as exc:  # handed to the consumer, which raises it
            rows.put(exc)
        finally:
            close = getattr(iterator, "close", None)
            if callable(close):
                close()

    reader = threading.Thread(target=read, name="selfrag-batch-rows", daemon=True)
    reader.start()
    checked = time.monotonic()
    try:
        while True:
            try:
                item = rows.get(timeout=every_s)
            except queue.Empty:
                item = None
            if time.monotonic() - checked >= every_s:
                watch.check()
                checked = time.monotonic()
            if item is None:
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # A reader blocked in Ray Data stays blocked (a daemon thread: the process may exit).
        stop.set()


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
    retry_failed: bool = False,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> BatchSummary:
    """Answer every question of `source` not yet in `out`, appending one record per id (with
    `retry_failed`, also those whose last record in `out` is an error). Holds `out`'s lock for
    the run (OutputLockedError when another run has it). `on_record` sees each record right
    after it is written."""
    started = time.perf_counter()
    with lock_output(out):
        questions, problems = read_questions(source)
        # Unreadable rows own their ids like questions do, and count in --shard and --limit
        # by their position, so each gets one record in one shard.
        rows: list[BatchQuestion | InputProblem] = sorted(
            [*questions, *(p for p in problems if p.id is not None)], key=lambda r: r.line
        )
        chosen = select(rows, limit, shard)
        statuses, superseded = last_statuses(out)
        todo = [
            r
            for r in chosen
            if r.id not in statuses or (retry_failed and statuses[r.id] == "error")
        ]
        unreadable = [r for r in todo if isinstance(r, InputProblem)]
        reported = sorted(
            [*(p for p in problems if p.id is None), *unreadable], key=lambda p: p.line
        )
        summary = BatchSummary(malformed=len(reported), problems=reported)
        summary.skipped = len(chosen) - len(todo)
        summary.retried = sum(1 for r in todo if r.id in statuses)
        for p in reported:  # each once: the summary only counts them
            log.warning("skipped %s:%d: %s", source, p.line, p.reason)
        jobs, invalid = plan_jobs(
            [r for r in todo if isinstance(r, BatchQuestion)], settings.decoding
        )
        _answer_into(
            settings,
            out,
            jobs,
            [*map(malformed_record, unreadable), *invalid],
            summary,
            total=len(todo),
            actors=actors,
            per_actor=per_actor,
            address=address,
            progress=progress,
            actor_cpus=actor_cpus,
            on_record=on_record,
        )
        if superseded or summary.retried:
            compact_records(out)  # a finished run leaves one record per id
    summary.seconds = time.perf_counter() - started
    return summary


def _answer_into(
    settings: Settings,
    out: Path,
    jobs: Sequence[_Job],
    errors: Sequence[dict[str, Any]],
    summary: BatchSummary,
    *,
    total: int,
    actors: int | None,
    per_actor: int,
    address: str | None,
    progress: bool,
    actor_cpus: float | None,
    on_record: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Append `errors`, then the answers of `jobs` as they stream back, counting in `summary`."""
    sink = RecordSink(out)
    bar = tqdm(
        total=total,
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
        for record in errors:
            if record["error"]["type"] != "malformed":
                summary.failed += 1
            emit(record)
        earlier = earlier_answers(out, {job.key for job in jobs})
        for job in jobs:
            if job.key in earlier:
                first, response = earlier[job.key]
                summary.duplicates += len(job.ids)
                for ident in job.ids:
                    summary.answered += 1
                    summary.cache_hits += 1
                    emit(ok_record(ident, job.question, response, duplicate_of=first))
        pending = [job for job in jobs if job.key not in earlier]
        if pending:
            started_ray = ensure_ray(address)
            answers = stream_answers(
                settings, pending, actors=actors, per_actor=per_actor, actor_cpus=actor_cpus
            )
            for job, outcome in _node_lost_said(answers, summary, out):
                summary.duplicates += len(job.ids) - 1
                for n, ident in enumerate(job.ids):
                    if outcome["status"] == "ok":
                        summary.answered += 1
                        if outcome["cache"] == "hit" or n > 0:
                            summary.cache_hits += 1
                        first = job.ids[0] if n > 0 else None
                        record = ok_record(ident, job.question, outcome["response"], first)
                    else:
                        summary.failed += 1
                        error = outcome["error"]
                        record = error_record(ident, job.question, error["type"], error["message"])
                    emit(record)
    finally:
        bar.close()
        sink.close()
        if started_ray:
            import ray

            ray.shutdown()


def _node_lost_said(answers: Iterator[_T], summary: BatchSummary, out: Path) -> Iterator[_T]:
    """`answers`; a NodeLost says what this run wrote and how to finish."""
    try:
        yield from answers
    except NodeLost as exc:
        raise NodeLost(
            f"{exc}. Stopped: {summary.answered} answered and {summary.failed} failed are in "
            f"{out}; run the same command again to answer the rest on the nodes left"
        ) from None


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
    report). `questions` are `selfrag.jobs.evaluation.EvalQuestion`. p_ret is the first segment's
    (no extra probe), and latency is the decoder's own total time, batched with others."""
    from selfrag.jobs.evaluation import RECORDS_FILE, make_record, read_records

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
