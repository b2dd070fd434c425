"""The passage KV-state cache: saved llama.cpp sequence states of reusable prompt prefixes.

Prompts put "template + passage" first (`reusable_prefix` on the engine's requests), so the KV
state of those tokens is the same whatever question follows. The engine saves it with
`llama_state_seq_get_data` after computing it once and restores it with
`llama_state_seq_set_data` into any sequence later, far cheaper than computing the passage's
prefill again (notes/benchmarks.md, "Passage KV-state cache").

The key is exact: the model file's SHA-256, the context layout (a state restores only into a
context with the same n_ctx, n_seq_max, unified-KV setting and KV types), the state format of
this llama.cpp build, and the prefix's token ids (which cover the template version and the
passage content). A passage's KV computed behind a different prefix is never shifted into place:
that is only approximate.

Tiers, nearest first: an in-process LRU, the node's disk (`infra.cache.kv_disk.DiskTier`, shared by
every engine process on the node, kept across restarts; `selfrag index --precompute-kv` fills
it), then Redis across nodes. States read from disk or Redis are checked before the engine
sees them: the exact prefix token ids are stored with each state and must equal the ones asked
for, a SHA-256 covers the state, and a value over the tier's cap is not read. A refused state
counts in `counters()` (`disk_rejected`, `redis_rejected_*`) and reads as a miss, so the engine
recomputes it. The memory tier holds only states this process computed or already checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from selfrag.infra.cache.kv_disk import DiskTier
from selfrag.infra.cache.tiers import MB, MemoryLRU, RedisTier, open_redis_tier
from selfrag.schemas.settings import Settings

log = logging.getLogger("selfrag.kv_cache")

# Bump when what a stored state means changes (e.g. how the engine lays out sequences), or how
# it is stored (2: sealed with its tokens and a checksum in Redis).
STATE_FORMAT = 2


@dataclass(frozen=True)
class ContextLayout:
    """What a llama.cpp context must match for a saved sequence state to restore into it."""

    n_ctx: int
    n_seq_max: int
    kv_unified: bool
    type_k: int
    type_v: int
    llama_cpp_version: str


@dataclass(frozen=True)
class PrefixKey:
    """Where the KV state of one prefix is stored: `digest` names it (model, layout, state
    format and tokens); `tokens` (the prefix's token ids as little-endian int32) travel with
    the state to Redis and must match exactly when it is read back."""

    digest: str
    tokens: bytes


State = bytes | memoryview
"""A saved sequence state: bytes, or a writable view of a disk file's checked copy in this
process's memory (restored without copying again; never a mapping of the file)."""


class PrefixStateStore(Protocol):
    """Saved sequence states by key. Implementations never raise from get/put."""

    def get(self, key: PrefixKey) -> State | None: ...

    def put(self, key: PrefixKey, state: bytes) -> None: ...


def prefix_state_key(model_sha256: str, layout: ContextLayout, tokens: Sequence[int]) -> PrefixKey:
    """Content address of the KV state of `tokens` computed from position 0 in `layout`."""
    ids = np.asarray(tokens, dtype="<i4").tobytes()
    h = hashlib.sha256()
    h.update(json.dumps([STATE_FORMAT, model_sha256, asdict(layout)], sort_keys=True).encode())
    h.update(ids)
    return PrefixKey(h.hexdigest(), ids)


class TieredStateStore:
    """`PrefixStateStore` over an in-process LRU, the node's disk and Redis (each optional).

    Disk and Redis writes happen behind, on one background thread, so saving a state costs the
    engine only the copy into memory; when writes pile up (a slow disk or Redis), new ones are
    dropped.
    """

    NAMESPACE = "selfrag:kv"
    MAX_PENDING_WRITES = 8

    def __init__(
        self,
        memory: MemoryLRU | None,
        redis_tier: RedisTier | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self.memory = memory
        self.redis = redis_tier
        self.disk = disk
        self._lock = threading.Lock()
        self._pending = 0
        self._writer = (
            ThreadPoolExecutor(1, thread_name_prefix="selfrag-kv-write")
            if redis_tier is not None or disk is not None
            else None
        )
        self.memory_hits = 0
        self.disk_hits = 0
        self.redis_hits = 0
        self.misses = 0
        self.puts = 0
        self.writes_dropped = 0

    def get(self, key: PrefixKey) -> State | None:
        state: State | None = self.memory.get(key.digest) if self.memory is not None else None
        if state is not None:
            self._count("memory_hits")
            return state
        if self.disk is not None:
            state = self.disk.get(key.digest, bind=key.tokens)
            if state is not None:
                if self.memory is not None:
                    self.memory.put(key.digest, state)  # checked, and this process's own copy
                self._count("disk_hits")
                return state
        if self.redis is not None:
            state = self.redis.get(key.digest, bind=key.tokens)
            if state is not None:
                if self.memory is not None:
                    self.memory.put(key.digest, state)
                self._count("redis_hits")
                self._write_behind(key, state, redis=False)  # now on this node's disk too
                return state
        self._count("misses")
        return None

    def put(self, key: PrefixKey, state: bytes) -> None:
        self._count("puts")
        if self.memory is not None:
            self.memory.put(key.digest, state)
        self._write_behind(key, state, redis=True)

    def _write_behind(self, key: PrefixKey, state: bytes, *, redis: bool) -> None:
        to_redis = redis and self.redis is not None
        if self._writer is None or not (to_redis or self.disk is not None):
            return
        with self._lock:
            if self._pending >= self.MAX_PENDING_WRITES:
                self.writes_dropped += 1
                return
            self._pending += 1
        self._writer.submit(self._write, key, state, to_redis)

    def _write(self, key: PrefixKey, state: bytes, to_redis: bool) -> None:
        try:
            if self.disk is not None:
                self.disk.put(key.digest, state, bind=key.tokens)
            if to_redis and self.redis is not None:
                self.redis.put(key.digest, state, bind=key.tokens)
        finally:
            with self._lock:
                self._pending -= 1

    def flush(self) -> None:
        """Wait for the disk and Redis writes queued so far (tests, shutdown)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def counters(self) -> Mapping[str, int]:
        with self._lock:
            out = {
                "memory_hit": self.memory_hits,
                "disk_hit": self.disk_hits,
                "redis_hit": self.redis_hits,
                "miss": self.misses,
                "put": self.puts,
                "write_dropped": self.writes_dropped,
            }
        if self.disk is not None:
            out |= self.disk.counters()
        if self.redis is not None:
            c = self.redis.counters
            out |= {"redis_error": c.errors, "redis_bypassed": c.bypassed}
            out |= {"redis_too_big": c.too_big}
            out |= {f"redis_{name}": n for name, n in c.rejected().items()}
        return out

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self.redis is not None:
            self.redis.close()

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


def open_prefix_store(settings: Settings) -> TieredStateStore | None:
    """The passage KV-state store `settings` ask for; None when `cache.passage_kv` is off."""
    c = settings.cache
    if not c.passage_kv:
        return None
    memory = MemoryLRU(max_bytes=c.kv_memory_mb * MB) if c.kv_memory_mb > 0 else None
    tier = open_redis_tier(
        settings, TieredStateStore.NAMESPACE, ttl_s=c.kv_ttl_s, max_bytes=c.kv_redis_mb * MB
    )
    disk = DiskTier(settings.home / "kv", c.kv_disk_mb * MB) if c.kv_disk_mb > 0 else None
    if memory is None and tier is None and disk is None:
        return None
    return TieredStateStore(memory, tier, disk)
