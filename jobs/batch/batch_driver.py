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
* Embedded Qdrant allows one client per folder, so with it a single `PassageService` owns the
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

The parts, by job: `jobs.batch.batch_inputs` (reading the input file),
`jobs.batch.batch_records` (the output file: lock, records, resume, compaction),
`jobs.batch.batch_answers` (answering jobs on Ray Data, with the store actor),
`jobs.batch.batch_actors` (the Ray actors) and `jobs.ray_pool` (sizing the pool to the cluster,
watching its nodes); this module is the driver.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from tqdm import tqdm

from selfrag.jobs.batch.batch_answers import BatchJob, stream_answers
from selfrag.jobs.batch.batch_inputs import BatchQuestion, InputProblem, read_questions, select
from selfrag.jobs.batch.batch_records import (
    BatchSummary,
    RecordSink,
    compact_records,
    earlier_answers,
    error_record,
    last_statuses,
    lock_output,
    malformed_record,
    ok_record,
)
from selfrag.jobs.first_use import answering_runtime
from selfrag.jobs.ray_pool import NodeLost, ensure_ray
from selfrag.runtime.answer_client import AnswerClient, LocalAnswerClient
from selfrag.runtime.answering import query_key
from selfrag.runtime.ray_cluster import shutdown_private_ray
from selfrag.schemas.answer import AnswerRequest
from selfrag.schemas.errors import AnswerError
from selfrag.schemas.settings import Settings

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def plan_jobs(
    questions: Iterable[BatchQuestion], client: AnswerClient
) -> tuple[list[BatchJob], list[dict[str, Any]]]:
    """Distinct jobs of the valid requests, each with its settled config (`client.config`),
    and an error record for each request that is invalid or that this model cannot answer."""
    jobs: dict[str, BatchJob] = {}
    errors: list[dict[str, Any]] = []
    for q in questions:
        try:
            request = AnswerRequest.model_validate({"question": q.question, "config": q.config})
        except ValidationError as exc:
            from selfrag.infra.settings_loader import describe_validation_error

            errors.append(error_record(q.id, q.question, "invalid", describe_validation_error(exc)))
            continue
        try:
            config = client.config(request)
        except AnswerError as exc:
            errors.append(error_record(q.id, q.question, exc.kind, exc.detail))
            continue
        # Index version and model are the same for the whole run, so they can stay out here.
        key = query_key(request.question, config, "", "")
        if key in jobs:
            jobs[key].ids.append(q.id)
        else:
            jobs[key] = BatchJob(key, request.question, config, [q.id])
    return list(jobs.values()), errors


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
        todo, unreadable, summary, superseded = _rows_to_answer(
            source, out, limit, shard, retry_failed
        )
        # Settled here, as every answer is (a missing threshold calibrated on first use);
        # the model files are read, no engine loaded for that alone.
        with answering_runtime(settings) as here:
            jobs, invalid = plan_jobs(
                [r for r in todo if isinstance(r, BatchQuestion)],
                LocalAnswerClient.for_runtime(here),
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


def _rows_to_answer(
    source: Path,
    out: Path,
    limit: int | None,
    shard: tuple[int, int] | None,
    retry_failed: bool,
) -> tuple[list[BatchQuestion | InputProblem], list[InputProblem], BatchSummary, int]:
    """The rows of `source` this run answers (those `limit` and `shard` choose, not yet in
    `out`), the unreadable ones among them, the summary counting what is skipped, and how many
    records of `out` a later one replaces."""
    questions, problems = read_questions(source)
    # Unreadable rows own their ids like questions do, and count in --shard and --limit
    # by their position, so each gets one record in one shard.
    rows: list[BatchQuestion | InputProblem] = sorted(
        [*questions, *(p for p in problems if p.id is not None)], key=lambda r: r.line
    )
    chosen = select(rows, limit, shard)
    statuses, superseded = last_statuses(out)
    todo = [
        r for r in chosen if r.id not in statuses or (retry_failed and statuses[r.id] == "error")
    ]
    unreadable = [r for r in todo if isinstance(r, InputProblem)]
    reported = sorted([*(p for p in problems if p.id is None), *unreadable], key=lambda p: p.line)
    summary = BatchSummary(malformed=len(reported), problems=reported)
    summary.skipped = len(chosen) - len(todo)
    summary.retried = sum(1 for r in todo if r.id in statuses)
    for p in reported:  # each once: the summary only counts them
        log.warning("skipped %s:%d: %s", source, p.line, p.reason)
    return todo, unreadable, summary, superseded


def _answer_into(
    settings: Settings,
    out: Path,
    jobs: Sequence[BatchJob],
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
        if record["status"] == "error":
            error = record["error"]
            summary.errors.append((record["id"], error["type"], error["message"]))
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
                for record in _earlier_records(job, earlier[job.key], summary):
                    emit(record)
        pending = [job for job in jobs if job.key not in earlier]
        if pending:
            started_ray = ensure_ray(address)
            answers = stream_answers(
                settings, pending, actors=actors, per_actor=per_actor, actor_cpus=actor_cpus
            )
            for job, outcome in _node_lost_said(answers, summary, out):
                for record in _outcome_records(job, outcome, summary):
                    emit(record)
    finally:
        bar.close()
        sink.close()
        if started_ray:
            shutdown_private_ray()


def _earlier_records(
    job: BatchJob, earlier: tuple[str, dict[str, Any]], summary: BatchSummary
) -> Iterator[dict[str, Any]]:
    """The records of `job`'s ids answered by an earlier record of the output, counted."""
    first, response = earlier
    summary.duplicates += len(job.ids)
    for ident in job.ids:
        summary.answered += 1
        summary.cache_hits += 1
        yield ok_record(ident, job.question, response, duplicate_of=first)


def _outcome_records(
    job: BatchJob, outcome: dict[str, Any], summary: BatchSummary
) -> Iterator[dict[str, Any]]:
    """The records of `job`'s ids from one answer's outcome, counted; ids after the first are
    duplicates of it."""
    summary.duplicates += len(job.ids) - 1
    for n, ident in enumerate(job.ids):
        if outcome["status"] == "ok":
            summary.answered += 1
            if outcome["cache"] == "hit" or n > 0:
                summary.cache_hits += 1
            first = job.ids[0] if n > 0 else None
            yield ok_record(ident, job.question, outcome["response"], first)
        else:
            summary.failed += 1
            error = outcome["error"]
            yield error_record(ident, job.question, error["type"], error["message"])


def _node_lost_said(answers: Iterator[_T], summary: BatchSummary, out: Path) -> Iterator[_T]:
    """`answers`; a NodeLost says what this run wrote and how to finish."""
    try:
        yield from answers
    except NodeLost as exc:
        raise NodeLost(
            f"{exc}. Stopped: {summary.answered} answered and {summary.failed} failed are in "
            f"{out}; run the same command again to answer the rest on the nodes left"
        ) from None
