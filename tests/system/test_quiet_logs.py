"""The quiet-stderr check itself (`tests/quiet_logs.py`). The runs it checks are the suite's
own: `selfrag serve` (start, answers, stop) and `selfrag batch` in
`tests/system/test_entry_points_agree.py`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.quiet_logs import assert_quiet, disk_alarms_dropped


def test_a_disk_alarm_is_forgiven_only_where_the_disk_is_that_full(tmp_path: Path):
    used = 1 - shutil.disk_usage(tmp_path).free / shutil.disk_usage(tmp_path).total
    assert used < 0.97, "this check needs a disk with room on it"
    alarm = (
        "(raylet) [2026-12-05 21:26:53,057 E 21523 21533] (raylet) file_system_monitor.cc:116: "
        f"{tmp_path}/ray/session_x is over {{}}% full, available space: 1 GB; capacity: 2 GB.\n"
    )
    assert disk_alarms_dropped("a\n" + alarm.format(0) + "b\n") == "a\nb\n"
    with pytest.raises(AssertionError):
        assert_quiet(alarm.format(99))


@pytest.mark.parametrize(
    "noise",
    [
        "Traceback (most recent call last):\n",
        "\x1b[33mcoloured\x1b[0m\n",
        "2026-12-07 WARNING something\n",
        "[2026-12-04 17:00:00,123 E 1234 5678] core_worker.cc:2465: lost\n",
        "selfrag: CPU backend x64\n",
    ],
)
def test_each_kind_of_noise_fails_the_check(noise: str):
    assert_quiet("selfrag: serving at http://127.0.0.1:8000/v1\n")
    with pytest.raises(AssertionError):
        assert_quiet("selfrag: serving at http://127.0.0.1:8000/v1\n" + noise)
