"""cli/terminal.py: what a command prints reaches the terminal without control characters, and
the real streams come back after the command, even when it fails."""

from __future__ import annotations

import io
import sys

import pytest

from selfrag.cli.terminal import TerminalSafeStream, terminal_safe_output


def test_the_stream_drops_what_a_terminal_would_obey_and_reports_the_length_given():
    out = io.StringIO()
    stream = TerminalSafeStream(out)
    assert stream.write("title\x1b]0;pwned\x07 end\n") == len("title\x1b]0;pwned\x07 end\n")
    stream.writelines(["a\rb\n", "\u202ec\td\n"])
    assert out.getvalue() == "title]0;pwned end\nab\nc\td\n"


def test_the_stream_passes_everything_else_to_the_wrapped_one():
    out = io.StringIO()
    stream = TerminalSafeStream(out)
    assert stream.isatty() is False
    stream.flush()
    assert stream.getvalue() == ""


def test_print_inside_a_command_is_made_safe_and_the_streams_come_back(
    capsys: pytest.CaptureFixture[str],
):
    before = sys.stdout, sys.stderr
    with terminal_safe_output():
        print("answer\x1b[2J here")
        print("warn\x9b\x07ing", file=sys.stderr)
    assert (sys.stdout, sys.stderr) == before
    captured = capsys.readouterr()
    assert captured.out == "answer[2J here\n"
    assert captured.err == "warning\n"


def test_the_streams_come_back_when_the_command_raises():
    before = sys.stdout, sys.stderr
    with pytest.raises(ValueError), terminal_safe_output():
        raise ValueError("bad input")
    assert (sys.stdout, sys.stderr) == before
