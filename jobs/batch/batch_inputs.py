"""Reading `selfrag batch` input files (JSONL, CSV, Parquet) into questions, with every
unreadable row kept as a problem under its own id or line, and choosing a run's share of them."""

from __future__ import annotations

import codecs
import csv
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from selfrag.infra.corpus.bounded_reads import JSONInputError, load_json, read_lines

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
