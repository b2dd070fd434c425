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
The folder is capped (`cache.kv_disk_mb`): past the cap the least recently used files go (a
read refreshes a file's mtime).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("selfrag.kv_cache")

MAGIC = b"SRKV"
FILE_FORMAT = 1
_HEADER = struct.Struct("<4sIIQ32s")  # magic, format, token bytes, state bytes, sha256
SUFFIX = ".kv"
# After eviction the folder is brought below this share of the cap, so a burst of writes does
# not evict on every one.
_EVICT_TO = 0.9


class DiskTier:
    """KV states as checked files in `folder`, at most `max_bytes` in all."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._bytes = self._scan_bytes()
        self.rejected = 0
        self.evicted = 0
        self.errors = 0

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
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_HEADER.pack(MAGIC, FILE_FORMAT, len(bind), n_state, h.digest()))
                    f.write(bind)
                    f.write(state)
                replaced = path.stat().st_size if path.exists() else 0
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            self._count_error(path, exc)
            return False
        with self._lock:
            self._bytes += size - replaced
            over = self._bytes > self.max_bytes
        if over:
            self.evict()
        return True

    def evict(self) -> int:
        """Delete the least recently used files until the folder is below the cap; returns
        how many went. Other processes may evict at the same time: a file already gone is
        skipped."""
        files = []
        for entry in self._entries():
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        target = self.max_bytes * _EVICT_TO
        gone = 0
        for _, size, path in sorted(files):
            if total <= target:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            total -= size
            gone += 1
        with self._lock:
            self._bytes = total
            self.evicted += gone
        return gone

    def size_bytes(self) -> int:
        """Bytes this tier believes it holds (rescanned on eviction)."""
        with self._lock:
            return self._bytes

    def counters(self) -> Mapping[str, int]:
        with self._lock:
            return {
                "disk_rejected": self.rejected,
                "disk_evicted": self.evicted,
                "disk_error": self.errors,
            }

    def _entries(self) -> list[os.DirEntry[str]]:
        out = []
        for sub in os.scandir(self.folder):
            if sub.is_dir():
                out.extend(e for e in os.scandir(sub.path) if e.name.endswith(SUFFIX))
        return out

    def _scan_bytes(self) -> int:
        total = 0
        for entry in self._entries():
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
        return total

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
