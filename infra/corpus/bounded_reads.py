"""Reading text from outside with bounds: JSON whose every failure is a `JSONInputError`
(nesting depth bounded on request), and the lines of a file with each line's memory bounded."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

# How much of an over-long line is read at a time while skipping to its end.
_SKIP_CHUNK = 1 << 16


class JSONInputError(ValueError):
    """Text from outside that is not a JSON value a reader accepts; the message says why, and
    `line` (1-based) where, for a syntax error."""

    def __init__(self, reason: str, line: int | None = None) -> None:
        super().__init__(reason)
        self.line = line


def load_json(text: str, max_depth: int | None = None) -> Any:
    """`json.loads` for text from outside (corpora, batch rows, datasets): every way it fails
    is a JSONInputError, never a RecursionError or the bare ValueError of an integer over
    Python's digit limit (`sys.get_int_max_str_digits()`). With `max_depth`, arrays and
    objects nested deeper than that are refused too, so that code walking the value
    recursively later (validation, repr, json.dumps) cannot hit the recursion limit either."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise JSONInputError(f"{exc.msg} ({where})", exc.lineno) from None
    except RecursionError:
        raise JSONInputError("arrays or objects nested too deeply to parse") from None
    except ValueError:  # json.loads raises it only for int() of too many digits
        limit = sys.get_int_max_str_digits()
        raise JSONInputError(f"an integer with more than {limit} digits") from None
    if max_depth is not None and _nested_deeper(value, max_depth):
        raise JSONInputError(f"arrays or objects nested deeper than {max_depth} levels")
    return value


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether `value` has arrays/objects nested more than `limit` deep (iteratively: no
    recursion on a value that may be as deep as the parser allowed)."""
    todo: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while todo:
        item, depth = todo.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        todo.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


@dataclass(frozen=True)
class RawLine:
    """One line of a file: `data` without its newline, or None when the line was over the limit
    (then it was skipped unread and only its `size` counted). `number` is 1-based."""

    number: int
    data: bytes | None
    size: int


def read_lines(file: BinaryIO, max_bytes: int) -> Iterator[RawLine]:
    """The lines of a binary file, reading at most `max_bytes` + 1 bytes of a line at once (a
    bounded readline holds up to twice that), so memory follows the limit, not the line: a line
    over `max_bytes` (newline excluded) is skipped to its end in 64 KiB reads and comes back
    with `data=None`; reading goes on at the next line."""
    number = 0
    while True:
        chunk = file.readline(max_bytes + 1)
        if not chunk:
            return
        number += 1
        if chunk.endswith(b"\n"):
            yield RawLine(number, chunk[:-1], len(chunk) - 1)
        elif len(chunk) <= max_bytes:  # the last line, without a newline
            yield RawLine(number, chunk, len(chunk))
        else:
            size = len(chunk)
            chunk = b""  # drop the head before reading on: memory stays bounded
            while rest := file.readline(_SKIP_CHUNK):
                if rest.endswith(b"\n"):
                    size += len(rest) - 1
                    break
                size += len(rest)
            yield RawLine(number, None, size)
