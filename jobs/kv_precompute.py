"""`selfrag index --precompute-kv` (`SelfRAG.precompute_kv`): the KV state of every indexed
passage's prompt head, computed once and saved to the disk tier, so answers start warm in every
process of the node and after a restart."""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from selfrag.pipeline.critics import Branch
from selfrag.runtime.system import LocalRuntime

if TYPE_CHECKING:
    from tqdm import tqdm

    from selfrag.infra.cache.kv_disk import DiskTier

# Any question: what is saved is the prompt head before it (template + passage).
KV_WARM_QUESTION = "What does this passage say?"


@dataclass(frozen=True)
class KVPrecompute:
    """What `precompute_kv` did."""

    passages: int
    computed: int
    disk_bytes: int
    seconds: float


def precompute_kv(rag: LocalRuntime, progress: bool = True, batch: int = 8) -> KVPrecompute:
    """Compute and save to the disk tier the KV state of every indexed passage's prompt head
    on `rag`, as answers reuse it (a relevance call per passage; a state already saved is
    restored instead, so a second run is quick). Prints the disk it will take after the first
    batch. ValueError when the configuration has no disk tier."""
    from tqdm import tqdm

    store = rag.prefix_store
    if rag.settings.model.backend != "llama_cpp" or store is None or store.disk is None:
        raise ValueError(
            "--precompute-kv needs the llama.cpp backend, cache.passage_kv on and "
            "cache.kv_disk_mb > 0"
        )
    disk = store.disk
    passages = list(rag.store.passages())
    critic = rag.critic("auto")
    started, before = time.perf_counter(), disk.size_bytes()
    bar = tqdm(total=len(passages), unit="passage", disable=not progress)
    for start in range(0, len(passages), batch):
        chunk = passages[start : start + batch]
        critic.relevance([Branch(KV_WARM_QUESTION, "", p) for p in chunk])
        store.flush()
        bar.update(len(chunk))
        if start == 0 and progress:
            per = (disk.size_bytes() - before) / len(chunk)
            write_estimate(bar, disk, per, len(passages))
    bar.close()
    counters = store.counters()
    return KVPrecompute(
        passages=len(passages),
        computed=counters.get("put", 0),
        disk_bytes=disk.size_bytes(),
        seconds=time.perf_counter() - started,
    )


def write_estimate(bar: tqdm, disk: DiskTier, per: float, passages: int) -> None:
    """The disk `passages` states of `per` bytes each will take, against the tier's cap and
    the disk's free space (on stderr, under the progress bar)."""
    need, free = per * passages, shutil.disk_usage(disk.folder).free
    bar.write(
        f"about {need / 2**20:,.0f} MiB for {passages} passages "
        f"({per / 2**20:.1f} MiB each; cap {disk.max_bytes / 2**20:,.0f} MiB, "
        f"{free / 2**20:,.0f} MiB free)",
        file=sys.stderr,
    )
    if need > disk.max_bytes:
        bar.write("the cap is smaller: the least recently used states will go", file=sys.stderr)
