"""The output file of `selfrag batch`: one lock per run, records appended as they arrive,
resume from the last record of each id, and the final compaction to one record per id."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfrag.infra.corpus.bounded_reads import load_json
from selfrag.infra.file_lock import FileLock, atomic_output, open_lines_for_append
from selfrag.jobs.batch.batch_inputs import InputProblem
from selfrag.runtime.answering import (
    query_key,
)
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.records import BatchRecord, RecordError, RecordErrorType


class OutputLockedError(OSError):
    """Another run holds the output file's lock."""


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
                # A response holds the settled config it was decoded with, as the jobs do.
                config = DecodingConfig.model_validate(response["config"])
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
    mode = stat.S_IMODE(path.stat().st_mode)  # the output keeps its permissions
    with atomic_output(path, mode=mode) as tmp, path.open("rb") as src, tmp.open("wb") as dst:
        for n, line in enumerate(src):
            ident = _record_id(line)
            if ident is not None and last[ident] != n:
                dropped += 1
                continue
            dst.write(line)
    return dropped


@contextmanager
def lock_output(out: Path) -> Iterator[Path]:
    """Hold `<out>.lock` (a `FileLock`, which holds in this process too) while writing `out`;
    raise OutputLockedError at once when another run holds it. The holder's pid is kept in the
    lock file, for the message another run gets."""
    lock = FileLock(out.with_name(out.name + ".lock"))
    if not lock.acquire(timeout_s=0):
        try:
            holder = lock.path.read_bytes()[:32].decode("ascii", "replace").strip()
        except OSError:
            holder = ""
        raise OutputLockedError(
            f"{out} is being written by another `selfrag batch` run"
            + (f" (pid {holder})" if holder.isdigit() else "")
            + f": it holds {lock.path}. Wait for it to finish, or write to another --out."
        )
    try:
        os.ftruncate(lock.fd, 0)
        os.pwrite(lock.fd, f"{os.getpid()}\n".encode(), 0)
        yield lock.path
    finally:
        lock.release()


class RecordSink:
    """Appends one JSON line per record and flushes it, so a crash loses nothing written."""

    def __init__(self, path: Path) -> None:
        self._file = open_lines_for_append(path)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class BatchSummary:
    """What one run did. `skipped`: ids already answered by an earlier run; `retried`: ids
    answered again because their last record was an error (`retry_failed`); `malformed`: rows
    that could not be read, reported with their line, and repeated ids. `errors`: the id,
    error type and message of every error record this run wrote."""

    answered: int = 0
    failed: int = 0
    skipped: int = 0
    retried: int = 0
    malformed: int = 0
    duplicates: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    problems: list[InputProblem] = field(default_factory=list)
    errors: list[tuple[str, str, str]] = field(default_factory=list)

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
