"""The query cache: answers by `runtime.answering.query_key`, on the two tiers of
`infra.cache.tiers` (an in-process LRU, then Redis when configured)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from pydantic import ValidationError

from selfrag.infra.cache.tiers import MB, MemoryLRU, RedisTier, open_redis_tier
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.settings import Settings

log = logging.getLogger("selfrag.cache")

# Answers are a few KB (the largest, with many long passages, well under 1 MB): a cached
# answer over this is not one selfrag wrote, and is not read.
MAX_ANSWER_BYTES = 4 * MB


class AnswerCache:
    """The query cache (`runtime.answering.QueryCache`): answers by `runtime.answering.query_key`,
    in an in-process LRU and, when configured, in Redis shared by all ingress replicas.

    Never raises from `get`/`put`: a Redis outage degrades to the in-process tier.
    """

    NAMESPACE = "selfrag:answer"

    def __init__(self, memory: MemoryLRU, redis_tier: RedisTier | None = None) -> None:
        self.memory = memory
        self.redis = redis_tier
        self._lock = threading.Lock()
        self.memory_hits = 0
        self.redis_hits = 0
        self.misses = 0
        self.corrupt = 0

    def get(self, key: str) -> AnswerResponse | None:
        raw = self.memory.get(key)
        tier = "memory"
        if raw is None and self.redis is not None:
            raw = self.redis.get(key)
            tier = "redis"
        if raw is None:
            self._count("misses")
            return None
        try:
            response = AnswerResponse.model_validate_json(raw)
        except ValidationError as exc:
            # Written by another version of the schema (or not by selfrag): treat as absent,
            # the answer computed instead replaces it.
            log.warning("query cache entry %s is no valid answer, ignoring it: %s", key, exc)
            self._count("corrupt")
            return None
        if tier == "redis":
            self.memory.put(key, raw)
        self._count("memory_hits" if tier == "memory" else "redis_hits")
        return response

    def put(self, key: str, response: AnswerResponse) -> None:
        raw = response.model_dump_json().encode()
        self.memory.put(key, raw)
        if self.redis is not None:
            self.redis.put(key, raw)

    def ping(self) -> bool:
        """Readiness: True without Redis; with Redis, whether it answers now."""
        return self.redis.ping() if self.redis is not None else True

    def counters(self) -> Mapping[str, int]:
        """Per-tier outcomes for `/metrics` (the ingress counts hit/miss itself)."""
        with self._lock:
            out = {
                "memory_hit": self.memory_hits,
                "redis_hit": self.redis_hits,
                "miss": self.misses,
                "corrupt": self.corrupt,
            }
        if self.redis is not None:
            c = self.redis.counters
            out |= {"redis_error": c.errors, "redis_bypassed": c.bypassed, "redis_put": c.puts}
            out |= {f"redis_{name}": n for name, n in c.rejected().items()}
        return out

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


def open_query_cache(settings: Settings) -> AnswerCache | None:
    """The query cache `settings` ask for (None when `cache.query` is off). Opening never
    contacts Redis, so a server that is down at start is bypassed like one that fails later."""
    c = settings.cache
    if not c.query:
        return None
    # Answers are a few KB; the entry count is the cap that matters in memory.
    memory = MemoryLRU(
        max_bytes=64 * MB, max_entries=c.query_memory_entries, ttl_s=float(c.query_ttl_s)
    )
    tier = open_redis_tier(
        settings,
        AnswerCache.NAMESPACE,
        ttl_s=c.query_ttl_s,
        max_bytes=c.query_redis_mb * MB,
        max_entry_bytes=MAX_ANSWER_BYTES,
    )
    return AnswerCache(memory, tier)
