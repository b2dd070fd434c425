"""An exclusive lock between processes on one file (flock), and the atomic file write: the one
implementation of each for the package.

The OS drops a flock when its holder exits, however it exits, so a killed process never leaves a
stale lock; the lock file itself stays (removing it would race with a process opening it).
Linux emulates flock with byte-range locks on NFS, so it also holds between the hosts of a
share.

A file is replaced atomically by writing a temporary file beside it (`TEMP_SUFFIX`, hidden) and
renaming it over the old one, so a reader sees the old content or the new, never a mix. A
JSON-lines file is appended to after ending a last line a killed writer tore
(`open_lines_for_append`), so the first new line is whole.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TextIO

_POLL_S = 0.05
TEMP_SUFFIX = ".tmp"
"""How a temporary file of `atomic_output` ends (after a leading dot and the target's name)."""


class FileLock:
    """`path` locked exclusively (flock) between `acquire` and `release`; the same instance is
    also a lock between this process's threads, so it is held by one thread at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._threads = threading.Lock()
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def fd(self) -> int:
        """The lock file, open for reading and writing while the lock is held (a few bytes of
        state shared by the holders can live in it)."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is not locked")
        return self._fd

    def acquire(self, timeout_s: float | None = None) -> bool:
        """Take the lock: wait for ever (`None`), up to `timeout_s` seconds, or only try (0).
        Returns whether it is held now."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._threads.acquire(timeout=-1 if timeout_s is None else timeout_s):
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                        break
                    except BlockingIOError:
                        # Polled, not blocking: a wait with a deadline cannot be interrupted.
                        if deadline is None or time.monotonic() >= deadline:
                            os.close(fd)
                            self._threads.release()
                            return False
                        time.sleep(_POLL_S)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            self._threads.release()
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        """Drop the lock; safe when it is not held."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        os.close(fd)  # drops the flock
        self._threads.release()

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def fsync_dir(folder: Path) -> None:
    """Make the renames and creations in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_output(path: Path, *, mode: int | None = None, durable: bool = True) -> Iterator[Path]:
    """A new empty temporary file beside `path` for the block to write, by name (a library that
    opens its own output can write it too); when the block ends without an exception the file
    replaces `path` in one rename, so a reader sees the old content or the new one, never a
    mix; on an exception it is removed and `path` is left as it was.

    The file is private (0600, as mkstemp makes it) unless `mode` says otherwise. `durable`:
    its data is synced before the rename and the folder after it, so after a crash `path` is
    the old content or the whole new one; without it a crash can leave a torn file, which only
    a cache that checks what it reads can accept. The folder must exist.
    """
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        if durable:
            # Opened again by name: the block may have replaced the file mkstemp made.
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes, mode: int | None = None, durable: bool = True) -> None:
    """Replace `path` with `data` through `atomic_output` (private unless `mode` says
    otherwise; synced unless not `durable`)."""
    with atomic_output(path, mode=mode, durable=durable) as tmp:
        tmp.write_bytes(data)


def open_lines_for_append(path: Path) -> TextIO:
    """`path` (and its folder) opened to append UTF-8 lines; a last line torn by a writer that
    was killed is ended first, so it stays one unreadable line (readers skip it) and does not
    swallow the next one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = path.open("a", encoding="utf-8")
    if f.tell():
        with path.open("rb") as tail:
            tail.seek(-1, os.SEEK_END)
            torn = tail.read(1) != b"\n"
        if torn:
            f.write("\n")
    return f
