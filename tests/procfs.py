"""A process's `/proc/PID/stat`, for the tests that watch processes by name, state or group."""

from __future__ import annotations

from pathlib import Path


def process_stat(pid: int | str) -> tuple[str, list[str]] | None:
    """(command name, the fields after it: state, ppid, pgrp, ...) of a live process or a
    zombie; None once it is gone. The name is cut at the last ")", as it may hold one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = stat.split("(", 1)[1].rsplit(")", 1)
    return name, rest.split()
