"""The CLI's standard streams, made safe for a terminal: everything printed goes through
`schemas.text.terminal_safe`, so a corpus title, a passage, a model's answer or a file name
cannot retitle the window, clear the screen or plant a link (JSON output escapes the C0
controls itself; the rest are dropped)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from selfrag.schemas.text import terminal_safe


class TerminalSafeStream:
    """A text stream that writes `terminal_safe(text)` to the stream it wraps."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(terminal_safe(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


@contextmanager
def terminal_safe_output() -> Iterator[None]:
    """`sys.stdout` and `sys.stderr` wrapped in `TerminalSafeStream` for one command."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = TerminalSafeStream(out), TerminalSafeStream(err)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
