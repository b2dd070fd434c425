"""The query cache: the in-process LRU, and a real Redis server that is killed and restarted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from selfrag.infra.cache.answer_cache import MAX_ANSWER_BYTES, AnswerCache, open_query_cache
from selfrag.infra.cache.tiers import MB, MemoryLRU, RedisTier
from selfrag.infra.settings_loader import load_settings
from selfrag.runtime.answering import query_key
from selfrag.schemas.answer import AnswerResponse, Usage
from selfrag.schemas.decoding import DecodingConfig
from tests.redis_proc import RedisProcess


def _response(question: str = "Who founded Normandy?", answer: str = "Rollo.") -> AnswerResponse:
    return AnswerResponse(
        question=question,
        answer=answer,
        abstained=False,
        segments=[],
        passages=[],
        usage=Usage(steps=1),
        timings_ms={"total": 12.5},
        model_id="m",
        critique="prompted",
        config=DecodingConfig(),
    )


# --- in-process tier --------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_by_entries_and_bytes():
    lru = MemoryLRU(max_bytes=10, max_entries=3)
    for k in "abc":
        lru.put(k, b"xx")
    assert lru.get("a") == b"xx"  # a is now the most recent
    lru.put("d", b"xx")
    assert lru.get("b") is None and lru.get("a") == b"xx" and len(lru) == 3
    lru.put("e", b"123456")  # 6 + 2 + 2 + 2 > 10 bytes: drop the oldest until it fits
    assert lru.nbytes <= 10 and lru.get("e") == b"123456"
    assert lru.put("huge", b"x" * 11) is False and lru.get("huge") is None


def test_lru_entries_expire_with_the_ttl():
    lru = MemoryLRU(max_bytes=100, ttl_s=0.05)
    lru.put("k", b"v")
    assert lru.get("k") == b"v"
    time.sleep(0.08)
    assert lru.get("k") is None and lru.nbytes == 0


def test_without_redis_the_cache_is_in_process(tmp_path: Path):
    cache = open_query_cache(load_settings(environ={"SELFRAG_HOME": str(tmp_path)}))
    assert cache is not None and cache.redis is None and cache.ping()
    cfg = DecodingConfig()
    key = query_key("Who founded  Normandy?", cfg, "index-v1", "model")
    assert cache.get(key) is None
    cache.put(key, _response())
    # Normalised question: case and spacing do not matter.
    hit = cache.get(query_key("who founded normandy?", cfg, "index-v1", "model"))
    assert hit == _response()
    # Re-indexing (a new index version) and another config are different answers.
    assert cache.get(query_key("Who founded Normandy?", cfg, "index-v2", "model")) is None
    other = cfg.model_copy(update={"top_k": cfg.top_k + 1})
    assert cache.get(query_key("Who founded Normandy?", other, "index-v1", "model")) is None
    assert cache.counters() == {"memory_hit": 1, "redis_hit": 0, "miss": 3, "corrupt": 0}


def test_the_query_cache_can_be_turned_off(tmp_path: Path):
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_CACHE__QUERY": "false"}
    assert open_query_cache(load_settings(environ=env)) is None


# --- the Redis tier -------------------------------------------------------------------------------


def _cache(url: str, tmp_path: Path, **cache: object) -> AnswerCache:
    env = {
        "SELFRAG_HOME": str(tmp_path),
        "SELFRAG_REDIS_URL": url,
        "SELFRAG_CACHE__REDIS_TIMEOUT_MS": "100",
        "SELFRAG_CACHE__REDIS_RETRY_S": "0.3",
    }
    env |= {f"SELFRAG_CACHE__{k.upper()}": str(v) for k, v in cache.items()}
    out = open_query_cache(load_settings(environ=env))
    assert out is not None and out.redis is not None
    return out


def test_replicas_share_answers_through_redis_with_a_ttl(redis_url: str, tmp_path: Path):
    first, second = _cache(redis_url, tmp_path), _cache(redis_url, tmp_path)
    assert first.ping()
    key = query_key("q", DecodingConfig(), "v1", "m")
    first.put(key, _response())
    # The second replica has an empty memory tier: the answer comes from Redis, then memory.
    assert second.get(key) == _response() and second.get(key) == _response()
    assert second.counters()["redis_hit"] == 1 and second.counters()["memory_hit"] == 1
    client = redis.Redis.from_url(redis_url)
    assert 0 < client.ttl(key) <= 86400  # type: ignore[operator]
    assert key.startswith(AnswerCache.NAMESPACE + ":")  # one namespace, no double prefix


def test_redis_tier_keeps_its_namespace_under_the_byte_cap(redis_url: str):
    tier = RedisTier(redis_url, "selfrag:test", ttl_s=60, max_bytes=10_000)
    # 900 bytes + the seal (48-byte header, the 16-byte key) per entry: ten fit.
    for i in range(30):
        assert tier.put(f"k{i}", bytes([i]) * 900)
    assert 9_000 <= tier.stored_bytes() <= 10_000
    # Oldest first out; the newest ten are all there.
    assert tier.get("k0") is None
    assert all(tier.get(f"k{i}") == bytes([i]) * 900 for i in range(20, 30))
    # Replacing a key does not count it twice; a value over the whole cap is refused.
    assert tier.put("k29", b"y" * 500) and tier.stored_bytes() <= 10_000
    assert tier.put("big", b"z" * 10_001) is False and tier.counters.too_big == 1
    client = redis.Redis.from_url(redis_url)
    assert client.zcard("selfrag:test:~index") == client.hlen("selfrag:test:~sizes") <= 10


def test_killed_redis_is_bypassed_counted_and_used_again_after_restart(
    redis_server: tuple[str, RedisProcess | None], redis_url: str, tmp_path: Path
):
    _, proc = redis_server
    if proc is None:
        pytest.skip("an external Redis ($REDIS_TEST_URL) cannot be killed")
    cache = _cache(redis_url, tmp_path)
    before = query_key("before", DecodingConfig(), "v1", "m")
    cache.put(before, _response("before"))
    proc.kill()

    start = time.perf_counter()
    # The memory tier still answers what it holds; the rest misses instead of failing.
    assert cache.get(before) == _response("before")
    for i in range(20):
        key = query_key(f"during {i}", DecodingConfig(), "v1", "m")
        assert cache.get(key) is None
        cache.put(key, _response(f"during {i}"))
    elapsed = time.perf_counter() - start
    # One failed call opens the bypass window: not 40 connection timeouts.
    assert elapsed < 1.0, elapsed
    c = cache.counters()
    assert c["redis_error"] >= 1 and c["redis_bypassed"] >= 1
    assert not cache.ping()

    proc.start()
    time.sleep(0.35)  # past redis_retry_s
    assert cache.ping()
    after = query_key("after", DecodingConfig(), "v1", "m")
    cache.put(after, _response("after"))
    fresh = _cache(redis_url, tmp_path)
    assert fresh.get(after) == _response("after") and fresh.counters()["redis_hit"] == 1


def test_slow_redis_times_out_and_is_bypassed(redis_url: str, tmp_path: Path):
    cache = _cache(redis_url, tmp_path)
    key = query_key("slow", DecodingConfig(), "v1", "m")
    other = redis.Redis.from_url(redis_url)
    other.execute_command("CLIENT", "PAUSE", 1000, "ALL")
    try:
        start = time.perf_counter()
        assert cache.get(key) is None
        cache.put(key, _response())
        assert time.perf_counter() - start < 0.5  # one 100 ms timeout, then bypassed
        assert cache.counters()["redis_error"] == 1 and cache.counters()["redis_bypassed"] == 1
    finally:
        other.execute_command("CLIENT", "UNPAUSE")
    assert cache.get(key) == _response()  # the memory tier took it meanwhile


def test_cache_settings_reach_the_tiers(tmp_path: Path):
    cache = _cache("redis://127.0.0.1:1/0", tmp_path, query_redis_mb=3, query_memory_entries=7)
    assert cache.redis is not None and cache.redis.max_bytes == 3 * MB
    assert cache.memory.max_entries == 7
    # Nothing listens on port 1: refused at once, never raised.
    assert cache.get("selfrag:answer:x") is None and not cache.ping()


# --- what a Redis value must prove before it is served ---------------------------------------


def _tier_counters(cache: AnswerCache) -> dict[str, int]:
    return {k: v for k, v in cache.counters().items() if k.startswith("redis_rejected_")}


def test_an_answer_written_into_redis_by_someone_else_is_not_served(redis_url: str, tmp_path: Path):
    """A well-formed answer SET straight into the right key (what anyone with write access to
    Redis could do) is refused; the genuine answer computed afterwards is served again."""
    cache, writer = _cache(redis_url, tmp_path), _cache(redis_url, tmp_path)
    key = query_key("Who founded Normandy?", DecodingConfig(), "v1", "m")
    client = redis.Redis.from_url(redis_url)
    client.set(key, _response(answer="Napoleon.").model_dump_json())
    assert cache.get(key) is None
    assert _tier_counters(cache)["redis_rejected_malformed"] == 1
    assert cache.counters()["redis_hit"] == 0 and cache.counters()["miss"] == 1
    writer.put(key, _response())  # the recomputed answer replaces the planted one
    assert cache.get(key) == _response()


def test_an_answer_moved_to_another_key_or_damaged_is_refused(redis_url: str, tmp_path: Path):
    writer, reader = _cache(redis_url, tmp_path), _cache(redis_url, tmp_path)
    client = redis.Redis.from_url(redis_url)
    mine = query_key("Who founded Normandy?", DecodingConfig(), "v1", "m")
    other = query_key("Who was Rollo?", DecodingConfig(), "v1", "m")
    writer.put(other, _response("Who was Rollo?", "A Viking."))
    client.set(mine, client.get(other))  # an intact entry, but another question's
    assert reader.get(mine) is None
    client.setrange(other, len(client.get(other)) - 3, b"XYZ")  # type: ignore[arg-type]
    assert reader.get(other) is None
    assert _tier_counters(reader) == {
        "redis_rejected_oversized": 0,
        "redis_rejected_malformed": 0,
        "redis_rejected_checksum": 1,
        "redis_rejected_mismatch": 1,
    }


def test_a_sealed_entry_that_is_no_answer_counts_as_corrupt(redis_url: str, tmp_path: Path):
    cache = _cache(redis_url, tmp_path)
    assert cache.redis is not None
    key = query_key("q", DecodingConfig(), "v1", "m")
    for i, raw in enumerate([b'{"answer": 1}', b"\xff\xfe not utf-8", b""]):
        assert cache.redis.put(key, raw)
        assert cache.get(key) is None
        assert cache.counters()["corrupt"] == i + 1


def test_an_oversized_answer_is_refused_without_reading_it(redis_url: str, tmp_path: Path):
    cache = _cache(redis_url, tmp_path)
    assert cache.redis is not None and cache.redis.max_entry_bytes == MAX_ANSWER_BYTES
    key = query_key("q", DecodingConfig(), "v1", "m")
    client = redis.Redis.from_url(redis_url)
    client.set(key, b"x" * (MAX_ANSWER_BYTES + 1))
    sent = int(client.info("stats")["total_net_output_bytes"])
    assert cache.get(key) is None
    # The reply to STRLEN is a few bytes; the 4 MB value never crossed the connection.
    assert int(client.info("stats")["total_net_output_bytes"]) - sent < 64 * 1024
    assert _tier_counters(cache)["redis_rejected_oversized"] == 1
    # Nor is an answer over the cap stored.
    assert cache.redis.put("big", b"y" * MAX_ANSWER_BYTES) is False


def test_a_key_of_another_type_is_refused_not_an_outage(redis_url: str, tmp_path: Path):
    cache = _cache(redis_url, tmp_path)
    key = query_key("q", DecodingConfig(), "v1", "m")
    redis.Redis.from_url(redis_url).rpush(key, b"a list")
    assert cache.get(key) is None
    c = cache.counters()
    assert c["redis_rejected_malformed"] == 1 and c["redis_error"] == 0
    cache.put(key, _response())  # no bypass window was opened: Redis is still used
    assert cache.counters()["redis_put"] == 1
    assert _cache(redis_url, tmp_path).get(key) == _response()
