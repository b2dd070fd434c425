"""`selfrag index --precompute-kv` (jobs/kv_precompute.py) on a real tiered store and disk tier,
with a critic that saves each passage's prompt head as the engine does: every indexed passage's
state saved once, batch by batch, the disk it takes estimated after the first batch, and a
configuration without a disk tier refused. The real model's run is in
tests/infra/cache/test_kv_disk.py."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from selfrag.infra.cache.kv_cache import PrefixKey, TieredStateStore
from selfrag.infra.cache.kv_disk import DiskTier
from selfrag.jobs.kv_precompute import KV_WARM_QUESTION, precompute_kv
from selfrag.pipeline.critics import Branch
from selfrag.pipeline.protocols import Passage
from selfrag.schemas.settings import Settings

STATE = bytes(range(256)) * 64


class HeadSavingCritic:
    """Reads relevance as the engine does for the prompt heads: a passage's saved state is
    restored, a missing one computed and saved."""

    def __init__(self, store: TieredStateStore) -> None:
        self.store = store
        self.calls: list[list[str]] = []

    def relevance(self, branches: Sequence[Branch]) -> list[Any]:
        assert {b.question for b in branches} == {KV_WARM_QUESTION}
        self.calls.append([b.passage.id for b in branches if b.passage is not None])
        for b in branches:
            assert b.passage is not None
            key = PrefixKey(hashlib.sha256(b.passage.id.encode()).hexdigest(), b"\x01\x00\x00\x00")
            if self.store.get(key) is None:
                self.store.put(key, STATE)
        return []


def _runtime(home: Path, passages: int, cap: int = 64 << 20, **model: Any) -> Any:
    store = TieredStateStore(None, disk=DiskTier(home / "kv", cap))
    critic = HeadSavingCritic(store)
    indexed = [Passage(id=f"p{i}", text=f"passage {i}") for i in range(passages)]
    return SimpleNamespace(
        settings=Settings(home=home, model=model),
        prefix_store=store,
        store=SimpleNamespace(passages=lambda: iter(indexed)),
        critic=lambda name: critic if name == "auto" else None,
    )


def test_every_passage_state_is_saved_once_in_batches(tmp_path: Path):
    rag = _runtime(tmp_path, passages=5)
    done = precompute_kv(rag, progress=False, batch=2)
    assert rag.critic("auto").calls == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    assert (done.passages, done.computed) == (5, 5)
    assert len(list((tmp_path / "kv").rglob("*.kv"))) == 5
    assert done.disk_bytes == rag.prefix_store.disk.size_bytes() >= 5 * len(STATE)
    # Another process (a second run) restores every state instead of computing it.
    again = precompute_kv(_runtime(tmp_path, passages=5), progress=False, batch=2)
    assert (again.passages, again.computed, again.disk_bytes) == (5, 0, done.disk_bytes)


def test_the_disk_it_takes_is_estimated_after_the_first_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    precompute_kv(_runtime(tmp_path / "roomy", passages=4), progress=True, batch=2)
    err = capsys.readouterr().err
    assert "MiB for 4 passages" in err and "the cap is smaller" not in err
    precompute_kv(_runtime(tmp_path / "tight", 4, cap=2 * len(STATE)), progress=True, batch=2)
    assert "the cap is smaller: the least recently used states will go" in capsys.readouterr().err


def test_without_a_disk_tier_or_llama_cpp_it_is_refused(tmp_path: Path):
    no_disk = _runtime(tmp_path, passages=1)
    no_disk.prefix_store = TieredStateStore(None)
    for rag in (no_disk, _runtime(tmp_path, passages=1, backend="vllm")):
        with pytest.raises(ValueError, match=r"cache\.kv_disk_mb > 0"):
            precompute_kv(rag, progress=False)
    no_store = _runtime(tmp_path, passages=1)
    no_store.prefix_store = None
    with pytest.raises(ValueError, match="--precompute-kv needs"):
        precompute_kv(no_store, progress=False)
