"""Two-tier caches: an in-process LRU first, then Redis (optional) with a TTL and a size cap.

The query cache of answers (`infra.cache.answer_cache`) and the passage KV-state store
(`infra.cache.kv_cache`) are built on `MemoryLRU` and `RedisTier`.

Redis is never allowed to fail a request: every Redis call has short socket timeouts, a
failure is logged and counted, and Redis is then bypassed for `retry_s` seconds (so an
outage costs one timeout per window, not one per request) before it is tried again.

Nor is a value read from Redis used on trust: every value is stored sealed (a header with its
key, any extra binding such as a prefix's token ids, its length and a SHA-256 of all that), and
a read refuses values over `max_entry_bytes` before transferring them and values whose seal
does not match the key asked for. Refusals are counted per reason (`RedisCounters`) and read
as misses, so the caller recomputes. The seal catches corruption, truncation and values stored
under the wrong key; it is no signature: whoever can write to Redis can forge it.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from selfrag.schemas.settings import Settings

log = logging.getLogger("selfrag.cache")

MB = 1 << 20


class MemoryLRU:
    """Thread-safe LRU of byte strings, capped by total bytes and entry count, with an
    optional TTL (so the first tier never outlives the Redis tier behind it)."""

    def __init__(
        self, max_bytes: int, max_entries: int | None = None, ttl_s: float | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._data: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                return None
            expires, value = entry
            if expires < time.monotonic():
                del self._data[key]
                self._bytes -= len(value)
                return None
            self._data.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> bool:
        """Store `value`, evicting the least recently used; False when it alone is too big."""
        if len(value) > self.max_bytes:
            return False
        expires = time.monotonic() + self.ttl_s if self.ttl_s is not None else float("inf")
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._data[key] = (expires, value)
            self._bytes += len(value)
            while self._bytes > self.max_bytes or (
                self.max_entries is not None and len(self._data) > self.max_entries
            ):
                _, (_, dropped) = self._data.popitem(last=False)
                self._bytes -= len(dropped)
        return True

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._data)


# Stores a value and keeps the namespace under its byte cap, oldest first. The books (insert
# time per key, size per key, total bytes) live next to the values; entries whose TTL ran out
# are dropped from them on the next put. Server time, so clients with skewed clocks agree.
_PUT_SCRIPT = """
local index, sizes, total_key = KEYS[2], KEYS[3], KEYS[4]
local ttl = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function forget(k)
  local s = tonumber(redis.call('HGET', sizes, k) or '0')
  redis.call('HDEL', sizes, k)
  redis.call('ZREM', index, k)
  redis.call('DECRBY', total_key, s)
end
for _, k in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now - ttl)) do forget(k) end
if redis.call('HEXISTS', sizes, KEYS[1]) == 1 then forget(KEYS[1]) end
local size = string.len(ARGV[1])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
redis.call('ZADD', index, now, KEYS[1])
redis.call('HSET', sizes, KEYS[1], size)
local total = redis.call('INCRBY', total_key, size)
while total > cap do
  local oldest = redis.call('ZRANGE', index, 0, 0)
  if #oldest == 0 or oldest[1] == KEYS[1] then break end
  redis.call('DEL', oldest[1])
  forget(oldest[1])
  total = tonumber(redis.call('GET', total_key))
end
for i = 2, 4 do redis.call('EXPIRE', KEYS[i], ttl) end
return total
"""


# A sealed value: magic (format 1), label length, payload length, SHA-256 over the label and
# the payload; then the label (the Redis key, a NUL, the caller's binding), then the payload.
_SEAL_MAGIC = b"SRC\x01"
_SEAL_HEAD = struct.Struct("<4sIQ32s")


class RejectedEntry(Exception):
    """A value read from Redis that is not used; `reason` is a `RedisCounters` field suffix."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def seal(label: bytes, payload: bytes) -> bytes:
    """`payload` sealed with `label`: a header with both lengths and their SHA-256, then both."""
    digest = hashlib.sha256(label)
    digest.update(payload)
    head = _SEAL_HEAD.pack(_SEAL_MAGIC, len(label), len(payload), digest.digest())
    return b"".join((head, label, payload))


def unseal(label: bytes, raw: bytes) -> bytes:
    """The payload of `raw` if it was sealed with `label`; raises RejectedEntry otherwise."""
    if len(raw) < _SEAL_HEAD.size or raw[:4] != _SEAL_MAGIC:
        raise RejectedEntry("malformed", "not a sealed selfrag entry")
    _, label_len, payload_len, expected = _SEAL_HEAD.unpack_from(raw)
    if _SEAL_HEAD.size + label_len + payload_len != len(raw):
        raise RejectedEntry(
            "malformed", f"lengths in its header do not add up to its {len(raw)} bytes"
        )
    view = memoryview(raw)
    stored_label = view[_SEAL_HEAD.size : _SEAL_HEAD.size + label_len]
    payload = view[_SEAL_HEAD.size + label_len :]
    digest = hashlib.sha256(stored_label)
    digest.update(payload)
    if digest.digest() != expected:
        raise RejectedEntry("checksum", "its SHA-256 does not match its content")
    # After the checksum: a mismatch then means a whole entry stored under the wrong key (or,
    # for KV states, for other prefix tokens), not a damaged one.
    if stored_label != label:
        raise RejectedEntry("mismatch", "it was stored for another key or other tokens")
    return payload.tobytes()


def seal_label(key: str, bind: bytes) -> bytes:
    """The label a value is sealed with: its Redis key, a NUL, the caller's binding."""
    return key.encode() + b"\0" + bind


@dataclass
class RedisCounters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    errors: int = 0
    """Calls that failed or timed out."""
    bypassed: int = 0
    """Calls not made because Redis failed less than `retry_s` ago."""
    too_big: int = 0
    """Values over `max_entry_bytes` (or the namespace's whole byte cap), never stored."""
    rejected_oversized: int = 0
    """Values read over `max_entry_bytes`: refused before being transferred."""
    rejected_malformed: int = 0
    """Values not sealed by this code (another format, inconsistent lengths, not a string)."""
    rejected_checksum: int = 0
    """Values whose SHA-256 does not match their content (damaged, truncated)."""
    rejected_mismatch: int = 0
    """Intact values sealed for another key or binding (e.g. other prefix tokens)."""

    def rejected(self) -> dict[str, int]:
        """The refusals by reason, as `rejected_<reason>` names."""
        return {
            "rejected_oversized": self.rejected_oversized,
            "rejected_malformed": self.rejected_malformed,
            "rejected_checksum": self.rejected_checksum,
            "rejected_mismatch": self.rejected_mismatch,
        }


class RedisTier:
    """One namespace of a Redis server: values with a TTL under a total byte cap.

    `get` and `put` never raise: failures are logged, counted in `counters`, and open a
    `retry_s` window during which Redis is bypassed. Values are sealed on `put` and checked
    on `get` (see the module docstring); a value over `max_entry_bytes` (default: the whole
    cap) is neither stored nor read.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        ttl_s: int,
        max_bytes: int,
        max_entry_bytes: int | None = None,
        timeout_s: float = 0.25,
        retry_s: float = 5.0,
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_entry_bytes = min(max_bytes, max_entry_bytes or max_bytes)
        self.retry_s = retry_s
        # No client-side retries: a retry would multiply the wait of a request on a dead server.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._put = self._client.register_script(_PUT_SCRIPT)
        self._response_error = redis.ResponseError
        self._books = [f"{namespace}:~index", f"{namespace}:~sizes", f"{namespace}:~bytes"]
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.counters = RedisCounters()

    def key(self, name: str) -> str:
        """The Redis key of `name` (names already in the namespace are used as they are)."""
        prefix = self.namespace + ":"
        return name if name.startswith(prefix) else prefix + name

    def get(self, name: str, bind: bytes = b"") -> bytes | None:
        """The value `put` under `name` with the same `bind`; None when absent, refused (too
        big, not sealed for this key and binding, damaged) or Redis is unavailable."""
        if self._skip():
            return None
        key = self.key(name)
        try:
            raw = self._read_capped(key)
        except RejectedEntry as rejected:
            self._up()
            self._rejected(key, rejected)
            return None
        except self._response_error as exc:  # e.g. WRONGTYPE: the server is fine, the key not
            self._up()
            self._rejected(key, RejectedEntry("malformed", f"{type(exc).__name__}: {exc}"))
            return None
        except Exception as exc:  # redis.RedisError, OSError: bypass, never fail the caller
            self._failed("get", exc)
            return None
        self._up()
        if raw is None:
            with self._lock:
                self.counters.misses += 1
            return None
        try:
            value = unseal(seal_label(key, bind), raw)
        except RejectedEntry as rejected:
            self._rejected(key, rejected)
            return None
        with self._lock:
            self.counters.hits += 1
        return value

    def put(self, name: str, value: bytes, bind: bytes = b"") -> bool:
        """Store `value` sealed with `name` and `bind`; False when it was not stored (too big,
        or Redis unavailable)."""
        key = self.key(name)
        sealed = seal(seal_label(key, bind), value)
        if len(sealed) > self.max_entry_bytes:
            with self._lock:
                self.counters.too_big += 1
            return False
        if self._skip():
            return False
        try:
            self._put(keys=[key, *self._books], args=[sealed, self.ttl_s, self.max_bytes])
        except Exception as exc:
            self._failed("put", exc)
            return False
        self._up()
        with self._lock:
            self.counters.puts += 1
        return True

    def ping(self) -> bool:
        """Whether Redis answers now (ignores the bypass window; success closes it)."""
        try:
            ok = bool(self._client.ping())
        except Exception as exc:
            self._failed("ping", exc)
            return False
        self._up()
        return ok

    def stored_bytes(self) -> int:
        """Bytes this namespace holds in Redis by its own books (0 when unavailable)."""
        try:
            return int(self._client.get(self._books[2]) or 0)  # type: ignore[arg-type]
        except Exception:
            return 0

    def close(self) -> None:
        self._client.close()

    def _read_capped(self, key: str) -> bytes | None:
        """The raw value of `key` (None when absent); RejectedEntry when over the cap.

        STRLEN first, so an oversized value is refused without a byte of it crossing the
        network; then GETRANGE up to one byte past the cap instead of GET, so a value that grew
        between the two calls still transfers at most that. (A Lua script doing both at once
        would copy every multi-MB state inside Redis twice.)
        """
        cap = self.max_entry_bytes
        size = int(self._client.strlen(key))  # type: ignore[arg-type]
        if size > cap:
            raise RejectedEntry("oversized", f"{size} bytes, over the {cap}-byte entry cap")
        if size == 0:
            return None  # absent (an empty value is no sealed entry either)
        raw = bytes(self._client.getrange(key, 0, cap))  # type: ignore[arg-type]
        if len(raw) > cap:
            raise RejectedEntry("oversized", f"over the {cap}-byte entry cap")
        return raw or None  # expired or deleted between the two calls

    def _rejected(self, key: str, rejected: RejectedEntry) -> None:
        with self._lock:
            name = f"rejected_{rejected.reason}"
            setattr(self.counters, name, getattr(self.counters, name) + 1)
            first = rejected.reason not in self._warned
            self._warned.add(rejected.reason)
        # One warning per reason (a poisoned key is read on every request); counters keep
        # the exact number.
        (log.warning if first else log.debug)(
            "redis %s: refused the value of %s (%s: %s); treating it as a miss",
            self.namespace,
            key,
            rejected.reason,
            rejected,
        )

    def _skip(self) -> bool:
        with self._lock:
            if time.monotonic() < self._down_until:
                self.counters.bypassed += 1
                return True
            return False

    def _failed(self, op: str, exc: BaseException) -> None:
        with self._lock:
            self.counters.errors += 1
            was_up = self._down_until == 0.0
            self._down_until = time.monotonic() + self.retry_s
        # One warning per outage; the counters keep the exact number.
        (log.warning if was_up else log.debug)(
            "redis %s %s failed, bypassing it for %.1f s: %s: %s",
            self.namespace,
            op,
            self.retry_s,
            type(exc).__name__,
            exc,
        )

    def _up(self) -> None:
        with self._lock:
            if self._down_until != 0.0:
                log.warning("redis %s answers again", self.namespace)
                self._down_until = 0.0


def open_redis_tier(
    settings: Settings,
    namespace: str,
    *,
    ttl_s: int,
    max_bytes: int,
    max_entry_bytes: int | None = None,
) -> RedisTier | None:
    """A `RedisTier` on `settings.redis_url`, or None when no URL is configured."""
    if not settings.redis_url:
        return None
    c = settings.cache
    return RedisTier(
        settings.redis_url.get_secret_value(),
        namespace,
        ttl_s=ttl_s,
        max_bytes=max_bytes,
        max_entry_bytes=max_entry_bytes,
        timeout_s=c.redis_timeout_ms / 1000,
        retry_s=c.redis_retry_s,
    )
