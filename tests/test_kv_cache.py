"""The passage KV-state store: keys, tiers, Redis write-behind and outage."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from infra.cache import MemoryLRU, RedisTier
from infra.kv_cache import ContextLayout, TieredStateStore, open_prefix_store, prefix_state_key
from infra.settings import load_settings
from tests.redis_proc import RedisProcess, redis_or_skip

LAYOUT = ContextLayout(
    n_ctx=8192, n_seq_max=16, kv_unified=True, type_k=1, type_v=1, llama_cpp_version="0.3.36"
)


def test_the_key_covers_model_layout_and_every_token():
    key = prefix_state_key("abc", LAYOUT, [1, 2, 3])
    assert key == prefix_state_key("abc", LAYOUT, [1, 2, 3])
    assert key != prefix_state_key("abd", LAYOUT, [1, 2, 3])
    assert key != prefix_state_key("abc", LAYOUT, [1, 2, 4])
    assert key != prefix_state_key("abc", LAYOUT, [1, 2])
    # A state restores only into a context laid out the same way.
    for change in (
        {"n_ctx": 4096},
        {"n_seq_max": 8},
        {"kv_unified": False},
        {"type_k": 8},
        {"type_v": 8},
        {"llama_cpp_version": "0.3.37"},
    ):
        changed = replace(LAYOUT, **change)  # type: ignore[arg-type]
        assert key != prefix_state_key("abc", changed, [1, 2, 3]), change


def test_memory_tier_and_settings(tmp_path: Path):
    store = open_prefix_store(load_settings(environ={"SELFRAG_HOME": str(tmp_path)}))
    assert store is not None and store.redis is None and store.memory is not None
    assert store.get("k") is None
    store.put("k", b"state")
    assert store.get("k") == b"state"
    assert store.counters()["memory_hit"] == 1 and store.counters()["miss"] == 1
    off = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_CACHE__PASSAGE_KV": "false"}
    assert open_prefix_store(load_settings(environ=off)) is None


@pytest.fixture(scope="module")
def redis_server() -> Iterator[tuple[str, RedisProcess | None]]:
    url, proc = redis_or_skip()
    yield url, proc
    if proc is not None:
        proc.kill()


@pytest.mark.real
def test_states_reach_redis_behind_and_survive_an_outage(
    redis_server: tuple[str, RedisProcess | None],
):
    url, proc = redis_server
    tier = RedisTier(
        url, "selfrag:kvtest", ttl_s=60, max_bytes=64 << 20, timeout_s=0.2, retry_s=0.2
    )
    store = TieredStateStore(MemoryLRU(1 << 20), tier)
    state = bytes(range(256)) * 8192  # 2 MB: over the memory tier, so only Redis keeps it
    store.put("k1", state)
    store.flush()
    other = TieredStateStore(None, tier)
    assert other.get("k1") == state and other.counters()["redis_hit"] == 1
    if proc is None:
        return
    proc.kill()
    assert other.get("k1") is None  # bypassed, not raised
    store.put("k2", b"x")
    store.flush()
    assert store.get("k2") == b"x"  # the memory tier still works
    assert other.counters()["redis_error"] >= 1
    proc.start()
