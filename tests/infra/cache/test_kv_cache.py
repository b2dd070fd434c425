"""The passage KV-state cache: keys, tiers, Redis write-behind and outage, and the engine's
restore/save of reusable prefixes against the real SmolLM2.

Restored states are compared with a recompute that splits the prompt the same way (prefix
decoded alone, then the rest): llama.cpp's CPU flash-attention kernel gives slightly different
results (up to ~0.03 nats) for the same prompt decoded in one call or in two, even with F32
weights, while with flash attention off the two agree bit for bit. That is numerics, not the
engine: the raw llama.cpp API shows the same difference.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis

from selfrag.infra.cache.kv_cache import (
    ContextLayout,
    TieredStateStore,
    open_prefix_store,
    prefix_state_key,
)
from selfrag.infra.cache.tiers import MemoryLRU, RedisTier
from selfrag.infra.engine.llama_engine import LlamaEngine
from selfrag.infra.models.model_files import default_model_path, derive_weights
from selfrag.infra.settings_loader import load_settings
from selfrag.pipeline.protocols import TokenScoreRequest
from tests.real import real
from tests.redis_proc import RedisProcess
from tests.suite import SUITE_ENV

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


KEY = prefix_state_key("abc", LAYOUT, list(range(100, 164)))


def test_memory_tier_and_settings(tmp_path: Path):
    store = open_prefix_store(load_settings(environ={"SELFRAG_HOME": str(tmp_path)}))
    assert store is not None and store.redis is None and store.memory is not None
    assert store.get(KEY) is None
    store.put(KEY, b"state")
    assert store.get(KEY) == b"state"
    assert store.counters()["memory_hit"] == 1 and store.counters()["miss"] == 1
    off = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_CACHE__PASSAGE_KV": "false"}
    assert open_prefix_store(load_settings(environ=off)) is None


def test_states_reach_redis_behind_and_survive_an_outage(
    redis_server: tuple[str, RedisProcess | None],
):
    url, proc = redis_server
    tier = RedisTier(
        url, "selfrag:kvtest", ttl_s=60, max_bytes=64 << 20, timeout_s=0.2, retry_s=0.2
    )
    store = TieredStateStore(MemoryLRU(1 << 20), tier)
    state = bytes(range(256)) * 8192  # 2 MB: over the memory tier, so only Redis keeps it
    k1, k2 = KEY, prefix_state_key("abc", LAYOUT, [1, 2])
    store.put(k1, state)
    store.flush()
    other = TieredStateStore(None, tier)
    assert other.get(k1) == state and other.counters()["redis_hit"] == 1
    if proc is None:
        return
    proc.kill()
    assert other.get(k1) is None  # bypassed, not raised
    store.put(k2, b"x")
    store.flush()
    assert store.get(k2) == b"x"  # the memory tier still works
    assert other.counters()["redis_error"] >= 1
    proc.start()


# --- states read from Redis are checked, never trusted ------------------------------------


def _redis_store(url: str, max_bytes: int = 1 << 20) -> TieredStateStore:
    """A store with Redis only (as a fresh replica's), on a 1 MB cap unless told."""
    tier = RedisTier(url, "selfrag:kvtest", ttl_s=60, max_bytes=max_bytes, timeout_s=0.5)
    return TieredStateStore(None, tier)


@pytest.mark.parametrize(
    ("poison", "reason"),
    [
        ("flipped", "checksum"),
        ("other_tokens", "mismatch"),
        ("other_key", "mismatch"),
        ("oversized", "oversized"),
        ("unsealed", "malformed"),
    ],
)
def test_a_poisoned_state_in_redis_is_refused_counted_and_replaced(
    redis_url: str, poison: str, reason: str
):
    """A value under the right key that is not exactly the state of these tokens is never
    returned: a flipped payload byte, a state sealed for other tokens or under another key, a
    value over the entry cap, or a bare state as an older version (or anyone) would SET it."""
    writer, reader = _redis_store(redis_url), _redis_store(redis_url)
    state = bytes(range(256)) * 64
    wrong = prefix_state_key("abc", LAYOUT, [*range(100, 163), 7])  # one token differs
    client = redis.Redis.from_url(redis_url)
    assert writer.redis is not None
    name = writer.redis.key(KEY.digest)
    writer.put(KEY, state)
    writer.put(wrong, state[::-1])
    writer.flush()
    if poison == "flipped":
        raw = client.get(name)
        assert isinstance(raw, bytes)
        client.setrange(name, len(raw) - 1, bytes([raw[-1] ^ 1]))
    elif poison == "other_tokens":
        writer.redis.put(KEY.digest, state[::-1], bind=wrong.tokens)
    elif poison == "other_key":
        client.set(name, client.get(writer.redis.key(wrong.digest)))  # type: ignore[arg-type]
    elif poison == "oversized":
        client.set(name, b"\0" * ((1 << 20) + 1))
    else:
        client.set(name, state[::-1])

    assert reader.get(KEY) is None
    counters = reader.counters()
    assert counters[f"redis_rejected_{reason}"] == 1
    assert sum(v for k, v in counters.items() if k.startswith("redis_rejected_")) == 1
    assert (counters["redis_hit"], counters["miss"], counters["redis_error"]) == (0, 1, 0)
    # The engine recomputes and saves the state: it replaces the poisoned value.
    reader.put(KEY, state)
    reader.flush()
    assert _redis_store(redis_url).get(KEY) == state


def test_refused_states_are_counted_in_the_pool_metrics(redis_url: str, tmp_path: Path):
    from selfrag.actors.http.metrics import EngineMetrics, PrometheusSink
    from selfrag.runtime.system import LocalRuntime

    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_REDIS_URL": redis_url, **SUITE_ENV}
    with LocalRuntime(load_settings(environ=env)) as rag:
        assert rag.kv_store_counters() == {}  # nothing opened just to report on it
        store = rag.prefix_store
        assert store is not None and store.redis is not None
        redis.Redis.from_url(redis_url).set(store.redis.key(KEY.digest), b"not a state")
        assert store.get(KEY) is None
        # What a BranchPool replica records after each request (deployments._EngineWorker).
        metrics = EngineMetrics([PrometheusSink("engine", process=False)])
        metrics.sync_kv_store(rag.kv_store_counters())
        text = metrics.render()
    assert "# TYPE selfrag_kv_cache_tier_total counter" in text
    assert 'selfrag_kv_cache_tier_total{event="redis_rejected_malformed"} 1.0' in text
    assert 'selfrag_kv_cache_tier_total{event="miss"} 1.0' in text


# --- the engine with a prefix-state store (real SmolLM2) ------------------------------------

THREADS = min(2, os.cpu_count() or 1)
TEMPLATE = (
    "<|im_start|>system\nJudge whether the passage answers the question.<|im_end|>\n"
    "<|im_start|>user\nPassage: "
)
PASSAGE = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to "
    "Normandy, a region in France. They were descended from Norse raiders and pirates from "
    "Denmark, Iceland and Norway who, under their leader Rollo, agreed to swear fealty to King "
    "Charles III of West Francia.\n\n"
)
QUESTIONS = ["Who was the Norse leader?", "In what country is Normandy located?"]


@pytest.fixture(scope="module")
@real
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return derive_weights(default_model_path(), "auto", tmp_path_factory.mktemp("kv-home"))


def _engine(weights: Path, store: TieredStateStore | None, n_seq_max: int = 4) -> LlamaEngine:
    return LlamaEngine(
        weights,
        n_ctx=1024,
        n_seq_max=n_seq_max,
        n_threads=THREADS,
        n_batch=512,
        model_id="smollm2",
        prefix_store=store,
        prefix_min_tokens=8,
    )


@pytest.fixture(scope="module")
@real
def engine(weights: Path) -> Iterator[LlamaEngine]:
    with _engine(weights, TieredStateStore(MemoryLRU(64 << 20))) as eng:
        yield eng


def _request(engine: LlamaEngine, question: str) -> tuple[TokenScoreRequest, list[int]]:
    prefix = engine.tokenize(TEMPLATE, special=True) + engine.tokenize(PASSAGE)
    tail = engine.tokenize(f"Question: {question}<|im_end|>\n<|im_start|>assistant\n", special=True)
    every = list(range(engine.n_vocab))
    return TokenScoreRequest(prefix + tail, every, reusable_prefix=len(prefix)), prefix


def _fresh(engine: LlamaEngine, store: TieredStateStore | None) -> None:
    engine.clear_cache()
    engine.reset_stats()
    engine.prefix_store = store


def test_restored_prefix_equals_recompute_with_the_same_split(engine: LlamaEngine):
    store = TieredStateStore(MemoryLRU(64 << 20))
    for question in QUESTIONS:
        req, prefix = _request(engine, question)
        # Recompute with the split a restore implies: the prefix alone, then the rest.
        _fresh(engine, None)
        engine.next_token_logprobs([TokenScoreRequest(prefix, [0])])
        recomputed = np.array(engine.next_token_logprobs([req])[0].logprobs)

        _fresh(engine, store)
        first = engine.next_token_logprobs([req])[0]  # cold for the first question
        _fresh(engine, store)
        warm = engine.next_token_logprobs([req])[0]
        stats = engine.stats
        assert stats.kv_restores == 1 and stats.kv_restored_tokens == len(prefix)
        # Only the question was decoded: the warm cache saved the passage's prefill.
        assert warm.prefill_tokens == stats.prefill_tokens == len(req.prompt) - len(prefix)
        assert first.prefill_tokens == len(req.prompt) or question != QUESTIONS[0]
        np.testing.assert_allclose(first.logprobs, recomputed, atol=1e-4, rtol=0)
        np.testing.assert_allclose(warm.logprobs, recomputed, atol=1e-4, rtol=0)
    assert store.counters()["put"] == 1  # one passage, one saved state


def test_the_key_follows_the_context_layout(engine: LlamaEngine, weights: Path):
    store = TieredStateStore(MemoryLRU(64 << 20))
    _fresh(engine, store)
    req, prefix = _request(engine, QUESTIONS[0])
    engine.next_token_logprobs([req])
    assert engine.stats.kv_saves == 1
    with _engine(weights, store, n_seq_max=2) as other:
        assert other.layout != engine.layout and other.model_sha256 == engine.model_sha256
        assert prefix_state_key(other.model_sha256 or "", other.layout, prefix) != (
            prefix_state_key(engine.model_sha256 or "", engine.layout, prefix)
        )
        other.next_token_logprobs([req])
        s = other.stats
        # A miss under its own key: a state of the other layout is never tried.
        assert (s.kv_misses, s.kv_restore_failures, s.kv_restores, s.kv_saves) == (1, 0, 0, 1)


@pytest.mark.parametrize("kind", ["garbage", "truncated", "foreign"])
def test_a_bad_stored_state_falls_back_to_recompute(engine: LlamaEngine, kind: str):
    store = TieredStateStore(MemoryLRU(64 << 20))
    req, prefix = _request(engine, QUESTIONS[0])
    _fresh(engine, store)
    expected = engine.next_token_logprobs([req])[0].logprobs
    key = prefix_state_key(engine.model_sha256 or "", engine.layout, prefix)
    good = store.get(key)
    assert good is not None
    if kind == "garbage":
        bad = bytes(range(256)) * 64
    elif kind == "truncated":
        bad = good[: len(good) // 2]
    else:  # a valid state of another prefix (fewer tokens)
        short = TokenScoreRequest([*prefix[:-5], 0], [0], reusable_prefix=len(prefix) - 5)
        _fresh(engine, store)
        engine.next_token_logprobs([short])
        bad = store.get(prefix_state_key(engine.model_sha256 or "", engine.layout, prefix[:-5]))
        assert bad is not None
    store.put(key, bad)
    _fresh(engine, store)
    got = engine.next_token_logprobs([req])[0]
    s = engine.stats
    assert (s.kv_restore_failures, s.kv_restores, s.kv_saves) == (1, 0, 1)
    assert got.prefill_tokens == len(req.prompt)
    np.testing.assert_allclose(got.logprobs, expected, atol=1e-4, rtol=0)
    assert store.get(key) == good  # the recomputed state replaced the bad one


def test_a_poisoned_redis_state_is_recomputed_not_restored(engine: LlamaEngine, redis_url: str):
    """The state of a prefix of the same length but one other passage token restores without
    complaint from llama.cpp and would change every score; copied under the right key in Redis
    it is refused (counted) and the engine recomputes the prefix."""
    req, prefix = _request(engine, QUESTIONS[0])
    _fresh(engine, None)  # recomputed with the split a staged prefix implies
    engine.next_token_logprobs([TokenScoreRequest(prefix, [0])])
    expected = engine.next_token_logprobs([req])[0].logprobs
    altered = list(prefix)
    altered[len(altered) // 2] = engine.tokenize(" Paris")[-1]
    assert altered != prefix
    store = _redis_store(redis_url, 256 << 20)  # SmolLM2: ~23 KB a token
    _fresh(engine, store)
    engine.next_token_logprobs([TokenScoreRequest([*altered, 0], [0], len(altered))])
    store.flush()
    assert store.redis is not None
    sha = engine.model_sha256 or ""
    client = redis.Redis.from_url(redis_url)
    planted = client.get(store.redis.key(prefix_state_key(sha, engine.layout, altered).digest))
    assert planted is not None
    key = prefix_state_key(sha, engine.layout, prefix)
    client.set(store.redis.key(key.digest), planted)  # type: ignore[arg-type]

    fresh = _redis_store(redis_url, 256 << 20)
    _fresh(engine, fresh)
    got = engine.next_token_logprobs([req])[0]
    s = engine.stats
    assert (s.kv_restores, s.kv_misses, s.kv_saves) == (0, 1, 1)
    assert fresh.counters()["redis_rejected_mismatch"] == 1
    assert got.prefill_tokens == len(req.prompt)
    np.testing.assert_allclose(got.logprobs, expected, atol=1e-4, rtol=0)

    # What the check prevents: the same state handed over unchecked restores without a
    # complaint and changes the scores.
    state = store.get(prefix_state_key(sha, engine.layout, altered))
    assert state is not None
    unchecked = TieredStateStore(MemoryLRU(64 << 20))
    unchecked.put(key, state)
    _fresh(engine, unchecked)
    poisoned = engine.next_token_logprobs([req])[0]
    assert engine.stats.kv_restores == 1
    assert np.abs(np.array(poisoned.logprobs) - np.array(expected)).max() > 1e-2
