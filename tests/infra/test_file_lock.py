"""infra/file_lock.py: the lock between processes and threads, and the atomic file write."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from selfrag.infra.file_lock import (
    TEMP_SUFFIX,
    FileLock,
    atomic_output,
    open_lines_for_append,
    write_atomic,
)
from tests.paths import ROOT


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(TEMP_SUFFIX))


def test_atomic_output_replaces_the_file_only_when_the_block_succeeds(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_bytes(b"old")
    with atomic_output(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.json.")
        assert tmp.read_bytes() == b"" and target.read_bytes() == b"old"
        tmp.write_bytes(b"new")
        assert target.read_bytes() == b"old"  # nothing visible before the block ends
    assert target.read_bytes() == b"new" and _leftovers(tmp_path) == []

    with pytest.raises(RuntimeError, match="half way"), atomic_output(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("half way")
    assert target.read_bytes() == b"new" and _leftovers(tmp_path) == []


def test_atomic_output_is_private_unless_a_mode_is_given(tmp_path: Path) -> None:
    write_atomic(tmp_path / "private", b"x")
    write_atomic(tmp_path / "shared", b"x", mode=0o644)
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o644
    assert (tmp_path / "shared").read_bytes() == b"x"


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch, target: Path) -> list[tuple[str, bytes]]:
    """(what was synced, `target`'s content at that moment) for each fsync."""
    synced: list[tuple[str, bytes]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        synced.append((kind, target.read_bytes()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_a_durable_write_syncs_the_data_before_the_rename_and_the_folder_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old")
    synced = _record_fsyncs(monkeypatch, target)
    with atomic_output(target, mode=0o644) as tmp:
        # A writer that makes its own file at the name (as some libraries do) is synced too.
        tmp.unlink()
        tmp.write_bytes(b"new")
    assert synced == [("file", b"old"), ("dir", b"new")]
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o644


def test_a_write_that_need_not_be_durable_syncs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.kv"
    synced = _record_fsyncs(monkeypatch, target)
    write_atomic(target, b"cache", durable=False)
    assert synced == [] and target.read_bytes() == b"cache"


def test_a_writer_killed_before_its_rename_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_bytes(b"old")
    script = (
        "import os, signal, sys\nfrom pathlib import Path\n"
        "from selfrag.infra.file_lock import write_atomic\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        "write_atomic(Path(sys.argv[1]), b'new')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(target)], cwd=ROOT)
    assert done.returncode == -9
    assert target.read_bytes() == b"old"
    [temp] = _leftovers(tmp_path)  # what a cache's sweep finds by its suffix
    assert (tmp_path / temp).read_bytes() == b"new"


def _hold_in_another_process(lock: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path\n"
            "from selfrag.infra.file_lock import FileLock\n"
            "with FileLock(Path(sys.argv[1])):\n"
            "    print('held', flush=True); sys.stdin.read()",
            str(lock),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_a_lock_held_by_another_process_is_tried_waited_for_and_freed_by_its_death(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sub" / ".lock"
    holder = _hold_in_another_process(path)
    lock = FileLock(path)
    try:
        assert not lock.acquire(timeout_s=0) and not lock.held
        started = time.monotonic()
        assert not lock.acquire(timeout_s=0.3)
        assert time.monotonic() - started >= 0.3
    finally:
        holder.kill()  # dies holding the lock: the OS drops it
        holder.wait(10)
    assert lock.acquire(timeout_s=10) and lock.held
    lock.release()
    assert path.exists()  # the lock file stays: removing it would race with an opener


def test_two_locks_on_one_file_exclude_each_other_in_one_process(tmp_path: Path) -> None:
    first, second = FileLock(tmp_path / ".lock"), FileLock(tmp_path / ".lock")
    with first:
        assert not second.acquire(timeout_s=0)
        os.pwrite(first.fd, b"1234\n", 0)  # state shared by the holders
    assert second.acquire(timeout_s=0)
    assert os.pread(second.fd, 16, 0) == b"1234\n"
    second.release()
    second.release()  # safe when not held
    with pytest.raises(RuntimeError, match="not locked"):
        _ = second.fd


def test_one_lock_is_held_by_one_thread_at_a_time(tmp_path: Path) -> None:
    lock = FileLock(tmp_path / ".lock")
    inside, most = 0, 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside, most
        for _ in range(20):
            with lock:
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.001)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most == 1
    with lock:
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(lock.acquire(timeout_s=0)))
        t.start()
        t.join(10)
        assert got == [False]


def test_appending_lines_ends_a_torn_last_line_first(tmp_path: Path):
    path = tmp_path / "new" / "records.jsonl"
    with open_lines_for_append(path) as f:  # the folder is made; an empty file gets no newline
        f.write("one\n")
    with open_lines_for_append(path) as f:
        f.write("two\n")
    path.write_text(path.read_text() + "thr")  # a writer killed mid-line
    with open_lines_for_append(path) as f:
        f.write("four\n")
    assert path.read_text().splitlines() == ["one", "two", "thr", "four"]
