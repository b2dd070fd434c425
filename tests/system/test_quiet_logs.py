"""What a normal run writes to a redirected stderr: `selfrag serve` (start, five answers, stop)
and a ten-question `selfrag batch` leave no traceback, colour code, warning or error there,
and the server says once where its API, playground and API docs are."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.real import real
from tests.redis_proc import free_port

RAY_NATIVE_ALARM = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [WEF] \d+ \d+\]")
"""The prefix of a line that Ray's C++ processes log at warning severity or worse, glog-style
("[2026-12-04 17:00:00,123 E 1234 5678] core_worker.cc:2465: ..."): no "WARNING" or "ERROR"
in it, only the letter."""
DISK_ALARM = re.compile(r"file_system_monitor\.cc:\d+: (\S+) is over (\d+)% full")
"""The raylet's alarm that the disk under Ray's temp folder is nearly full: a fact about the
machine, which CI machines share, not noise of selfrag's."""

FACTS = {
    "normandy": "Rollo, a Viking leader, founded the Duchy of Normandy in 911.",
    "paris": "Paris became the capital of France in 987 under Hugh Capet.",
    "eiffel": "The Eiffel Tower was completed in 1889 for the World's Fair.",
    "moon": "Neil Armstrong walked on the Moon in 1969.",
    "printing": "Johannes Gutenberg built his printing press around 1440.",
    "penicillin": "Alexander Fleming discovered penicillin in 1928.",
    "telephone": "Alexander Graham Bell patented the telephone in 1876.",
    "magna-carta": "King John sealed the Magna Carta in 1215.",
    "berlin": "The Berlin Wall fell in 1989.",
    "relativity": "Albert Einstein published special relativity in 1905.",
    "everest": "Edmund Hillary and Tenzing Norgay climbed Everest in 1953.",
    "hastings": "William the Conqueror won the Battle of Hastings in 1066.",
}
QUESTIONS = [
    "Who founded the Duchy of Normandy?",
    "When did Paris become the capital of France?",
    "When was the Eiffel Tower completed?",
    "Who walked on the Moon in 1969?",
    "Who built a printing press around 1440?",
    "Who discovered penicillin?",
    "When was the telephone patented?",
    "Who sealed the Magna Carta?",
    "When did the Berlin Wall fall?",
    "Who won the Battle of Hastings?",
]


def _selfrag(*args: str) -> list[str]:
    return [sys.executable, "-m", "selfrag", *args]


def _disk_alarms_dropped(stderr: str) -> str:
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


def _assert_quiet(stderr: str) -> None:
    stderr = _disk_alarms_dropped(stderr)
    assert "Traceback" not in stderr, stderr
    assert "\x1b[" not in stderr, stderr
    assert "WARNING" not in stderr and "ERROR" not in stderr, stderr
    assert not RAY_NATIVE_ALARM.search(stderr), stderr
    assert "CPU backend" not in stderr, stderr  # shown with -v only


@pytest.fixture(scope="module")
@real
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Markdown folder indexed (and its support threshold calibrated) by the CLI."""
    docs = tmp_path_factory.mktemp("docs")
    for name, text in FACTS.items():
        (docs / f"{name}.md").write_text(f"# {name.title()}\n\n{text}\n")
    home = tmp_path_factory.mktemp("home")
    env = {**os.environ, "SELFRAG_HOME": str(home)}
    done = subprocess.run(
        _selfrag("index", str(docs), "--no-progress"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return home


def test_serve_start_answers_and_stop_leave_stderr_quiet(home: Path, tmp_path: Path):
    port = free_port()
    err_path = tmp_path / "serve.err"
    env = {**os.environ, "SELFRAG_HOME": str(home)}
    with err_path.open("w") as err, (tmp_path / "serve.out").open("w") as out:
        server = subprocess.Popen(
            _selfrag("serve", "--port", str(port)), env=env, stdout=out, stderr=err
        )
        try:
            deadline = time.monotonic() + 300
            while "serving at" not in err_path.read_text():
                assert server.poll() is None, err_path.read_text()
                assert time.monotonic() < deadline, err_path.read_text()
                time.sleep(1)
            base = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=base, timeout=180) as api:
                for question in QUESTIONS[:5]:
                    body = {"question": question, "config": {"max_segments": 1}}
                    assert api.post("/v1/answer", json=body).status_code == 200
        finally:
            server.send_signal(signal.SIGINT)
            code = server.wait(timeout=120)
    assert code == 0
    stderr = err_path.read_text()
    _assert_quiet(stderr)
    (start,) = [line for line in stderr.splitlines() if "serving at" in line]
    assert f"{base}/v1" in start and f"playground {base}/" in start
    assert f"{base}/openapi.json" in start


def test_a_batch_leaves_stderr_quiet(home: Path, tmp_path: Path):
    source = tmp_path / "questions.jsonl"
    rows = [
        {"id": str(i), "question": q, "config": {"max_segments": 1}}
        for i, q in enumerate(QUESTIONS)
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "answers.jsonl"
    done = subprocess.run(
        _selfrag("batch", str(source), "--out", str(out)),
        env={**os.environ, "SELFRAG_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "answered=10 failed=0" in done.stdout
    _assert_quiet(done.stderr)


def test_a_disk_alarm_is_forgiven_only_where_the_disk_is_that_full(tmp_path: Path):
    used = 1 - shutil.disk_usage(tmp_path).free / shutil.disk_usage(tmp_path).total
    assert used < 0.97, "this check needs a disk with room on it"
    alarm = (
        "(raylet) [2026-12-05 21:26:53,057 E 21523 21533] (raylet) file_system_monitor.cc:116: "
        f"{tmp_path}/ray/session_x is over {{}}% full, available space: 1 GB; capacity: 2 GB.\n"
    )
    assert _disk_alarms_dropped("a\n" + alarm.format(0) + "b\n") == "a\nb\n"
    with pytest.raises(AssertionError):
        _assert_quiet(alarm.format(99))
