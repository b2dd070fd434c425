"""An exclusive lock between processes on one file (flock), and a durable atomic file write.

The OS drops a flock when its holder exits, however it exits, so a killed process never leaves a
stale lock; the lock file itself stays (removing it would race with a process opening it).
Linux emulates flock with byte-range locks on NFS, so it also holds between the hosts of a
share.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

_POLL_S = 0.05


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


def write_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace `path` with `data` so that a reader, or the file after a crash, is the old
    content or the new one, never a mix: a synced temporary file renamed into place. The file
    is private (0600, as mkstemp makes it) unless `mode` says otherwise."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
