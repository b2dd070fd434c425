"""The disk tier of the passage KV-state cache: one file per state under `SELFRAG_HOME/kv`,
shared by every engine process on the node and kept across restarts.

A file is `MAGIC`, the header (format, token bytes, state bytes), the SHA-256 of tokens and
state, the prefix's token ids, then the state. It is written to a temporary name and renamed
into place, so a reader sees a whole file or none. A read copies the file into memory (a
mapping would kill the process with SIGBUS once another process truncated the file, or a
shared volume dropped it), checks the header, the length (a truncated file is refused), the
tokens (they must equal the ones asked for) and the checksum, and hands out a writable view of
the copy: the engine restores from it without copying again. A refused file is deleted and
reads as a miss.

The folder is capped (`cache.kv_disk_mb`) for all the processes that share it: its size is kept
in `.lock`, updated under that file's lock (flock) after every write, and past the cap the
folder is counted file by file and the least recently used files go (a read refreshes a file's
mtime). It is also counted at open and at least once a minute, which corrects what a killed
writer left uncounted; temporary files count too, and one older than `STALE_TEMP_S` (left by a
killed writer) is deleted then. A process may write one file past the cap before it evicts, so
the folder holds at most the cap plus one state per process writing at that moment.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from selfrag.infra.file_lock import TEMP_SUFFIX, FileLock, atomic_output

log = logging.getLogger("selfrag.kv_cache")

MAGIC = b"SRKV"
FILE_FORMAT = 1
_HEADER = struct.Struct("<4sIIQ32s")  # magic, format, token bytes, state bytes, sha256
SUFFIX = ".kv"
# After eviction the folder is brought below this share of the cap, so a burst of writes does
# not evict on every one.
_EVICT_TO = 0.9
# The folder's size, shared by the processes writing it: bytes, and when it was last counted
# file by file. Kept in the lock file, read and written under the lock.
_USAGE = struct.Struct("<qd")
_LOCK_FILE = ".lock"
# The shared size is counted again file by file at least this often, so what it missed (a
# writer killed between its rename and its update) is corrected.
_RECOUNT_S = 60.0
STALE_TEMP_S = 600.0
"""A temporary file older than this was left by a killed writer (a live one renames its file
within seconds): it is deleted when the folder is counted."""


class DiskTier:
    """KV states as checked files in `folder`, at most `max_bytes` in all."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._folder_lock = FileLock(folder / _LOCK_FILE)
        self._bytes = 0
        self.rejected = 0
        self.evicted = 0
        self.errors = 0
        try:
            self.evict()  # counts the folder, left by other processes or a previous run
        except OSError as exc:  # a read-only folder still serves reads
            self._count_error(folder / _LOCK_FILE, exc)

    def _path(self, digest: str) -> Path:
        return self.folder / digest[:2] / (digest + SUFFIX)

    def get(self, digest: str, *, bind: bytes) -> memoryview | None:
        """The state saved under `digest` for the prefix tokens `bind`, or None."""
        path = self._path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._count_error(path, exc)
            return None
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER.size:
                return self._refuse(path, "shorter than its header")
            if size > self.max_bytes:
                return None  # written under a larger cap: not read whole into memory here
            # Copied, not mapped: a mapping of a file that another process truncates, or that
            # a shared volume drops, kills the process (SIGBUS) at the next touch of a page.
            data = _read_whole(fd, size)
        except OSError as exc:
            self._count_error(path, exc)
            return None
        finally:
            os.close(fd)
        magic, fmt, n_tokens, n_state, digest_bytes = _HEADER.unpack_from(data, 0)
        body = data[_HEADER.size :]
        if magic != MAGIC or fmt != FILE_FORMAT:
            return self._refuse(path, "not a KV state file of this format")
        if len(body) != n_tokens + n_state:
            return self._refuse(path, f"{len(body)} bytes where {n_tokens + n_state} belong")
        if body[:n_tokens] != bind:
            return self._refuse(path, "saved for other prefix tokens")
        if hashlib.sha256(body).digest() != digest_bytes:
            return self._refuse(path, "checksum mismatch")
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        return body[n_tokens:]

    def put(self, digest: str, state: bytes | memoryview, *, bind: bytes) -> bool:
        """Save `state`; False when it alone exceeds the cap or the disk refuses."""
        n_state = len(state)
        size = _HEADER.size + len(bind) + n_state
        if size > self.max_bytes:
            return False
        h = hashlib.sha256(bind)
        h.update(state)
        path = self._path(digest)
        try:
            path.parent.mkdir(exist_ok=True)
            # Not synced: a cache, and a file torn by a crash fails its checksum on read.
            with atomic_output(path, durable=False) as tmp:
                with tmp.open("wb") as f:
                    f.write(_HEADER.pack(MAGIC, FILE_FORMAT, len(bind), n_state, h.digest()))
                    f.write(bind)
                    f.write(state)
                replaced = path.stat().st_size if path.exists() else 0
        except OSError as exc:
            self._count_error(path, exc)
            return False
        try:
            self._account(size - replaced)
        except OSError as exc:
            self._count_error(self.folder / _LOCK_FILE, exc)
        return True

    def _account(self, added: int) -> None:
        """Add `added` bytes to the folder's shared size; past the cap (or when the size was
        last counted long ago), count the folder and evict."""
        with self._folder_lock:
            total, counted = self._read_usage()
            total += added
            if total > self.max_bytes or time.time() - counted > _RECOUNT_S:
                total = self._evict_locked()
            else:
                os.pwrite(self._folder_lock.fd, _USAGE.pack(total, counted), 0)
        with self._lock:
            self._bytes = total

    def evict(self) -> int:
        """Count the folder (every process's files, and temporary files; deleting those of
        killed writers) and delete the least recently used files while it is over the cap;
        returns how many went."""
        with self._folder_lock:
            before = self.evicted
            total = self._evict_locked()
        with self._lock:
            self._bytes = total
            return self.evicted - before

    def _evict_locked(self) -> int:
        """`evict` under the folder's lock; returns the folder's size, which it records.
        Processes of older versions may evict without the lock: a file already gone is
        skipped."""
        files, total = self._count_files()
        gone = 0
        if total > self.max_bytes:
            target = self.max_bytes * _EVICT_TO
            for _, size, path in sorted(files):
                if total <= target:
                    break
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                total -= size
                gone += 1
        os.pwrite(self._folder_lock.fd, _USAGE.pack(total, time.time()), 0)
        with self._lock:
            self.evicted += gone
        return total

    def _read_usage(self) -> tuple[int, float]:
        """The folder's shared size and when it was last counted; (0, 0.0), that is count it
        now, when the lock file holds none yet."""
        raw = os.pread(self._folder_lock.fd, _USAGE.size, 0)
        if len(raw) != _USAGE.size:
            return 0, 0.0
        total, counted = _USAGE.unpack(raw)
        return int(total), float(counted)

    def size_bytes(self) -> int:
        """Bytes in the folder, every process's, as of this tier's last write or eviction."""
        with self._lock:
            return self._bytes

    def counters(self) -> Mapping[str, int]:
        with self._lock:
            return {
                "disk_rejected": self.rejected,
                "disk_evicted": self.evicted,
                "disk_error": self.errors,
            }

    def _count_files(self) -> tuple[list[tuple[float, int, str]], int]:
        """The state files as (mtime, size, path), and the bytes of the folder: theirs and
        those of live writers' temporary files. Temporary files older than `STALE_TEMP_S`
        are deleted."""
        files = []
        total = 0
        stale_before = time.time() - STALE_TEMP_S
        for sub in os.scandir(self.folder):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                temp = entry.name.endswith(TEMP_SUFFIX)
                if not (temp or entry.name.endswith(SUFFIX)):
                    continue
                try:
                    st = entry.stat()
                    if temp and st.st_mtime < stale_before:
                        log.warning("deleting %s: left by a killed KV state writer", entry.path)
                        os.unlink(entry.path)
                        continue
                except FileNotFoundError:
                    continue
                total += st.st_size
                if not temp:
                    files.append((st.st_mtime, st.st_size, entry.path))
        return files, total

    def _refuse(self, path: Path, why: str) -> None:
        log.warning("KV state file %s refused (%s): deleted, will be recomputed", path, why)
        with self._lock:
            self.rejected += 1
        try:
            path.unlink()
        except OSError:
            pass
        return None

    def _count_error(self, path: Path, exc: OSError) -> None:
        log.warning("KV state file %s: %s", path, exc)
        with self._lock:
            self.errors += 1


def _read_whole(fd: int, size: int) -> memoryview:
    """Up to `size` bytes from the start of `fd`, into memory of this process (fewer when the
    file was cut meanwhile), as a writable view."""
    data = memoryview(bytearray(size))
    got = 0
    while got < size:
        n = os.preadv(fd, [data[got:]], got)
        if n == 0:
            break
        got += n
    return data[:got]
