"""What a normal run may write to a redirected stderr: no traceback, colour code, warning or
error, and no line Ray's C++ processes log at warning severity or worse (`assert_quiet`)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

RAY_NATIVE_ALARM = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [WEF] \d+ \d+\]")
"""The prefix of a line that Ray's C++ processes log at warning severity or worse, glog-style
("[2026-12-04 17:00:00,123 E 1234 5678] core_worker.cc:2465: ..."): no "WARNING" or "ERROR"
in it, only the letter."""
DISK_ALARM = re.compile(r"file_system_monitor\.cc:\d+: (\S+) is over (\d+)% full")
"""The raylet's alarm that the disk under Ray's temp folder is nearly full: a fact about the
machine, which CI machines share, not noise of selfrag's."""


def disk_alarms_dropped(stderr: str) -> str:
    """`stderr` less each `DISK_ALARM` line whose disk is indeed that full now (within two
    points: other processes write to it meanwhile)."""
    kept = []
    for line in stderr.splitlines(keepends=True):
        alarm = DISK_ALARM.search(line)
        if alarm is not None:
            folder = Path(alarm[1])
            while not folder.exists():
                folder = folder.parent
            usage = shutil.disk_usage(folder)
            if 1 - usage.free / usage.total >= int(alarm[2]) / 100 - 0.02:
                continue
        kept.append(line)
    return "".join(kept)


def assert_quiet(stderr: str) -> None:
    """Fails, showing `stderr`, if it holds anything a normal run should not write there."""
    stderr = disk_alarms_dropped(stderr)
    assert "Traceback" not in stderr, stderr
    assert "\x1b[" not in stderr, stderr
    assert "WARNING" not in stderr and "ERROR" not in stderr, stderr
    assert not RAY_NATIVE_ALARM.search(stderr), stderr
    assert "CPU backend" not in stderr, stderr  # shown with -v only
