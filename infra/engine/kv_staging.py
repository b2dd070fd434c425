"""Staging reusable prefixes (template + passage) into KV slots from a `PrefixStateStore`.

Before a group of requests is placed, `PrefixStager.stage` puts each request's reusable prefix
alone into a slot: restored from the store (memory, disk tier, Redis) when a state is there,
else decoded and then saved, so the next context or process restores it instead.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp

from selfrag.infra.cache.kv_cache import (
    ContextLayout,
    PrefixKey,
    PrefixStateStore,
    prefix_state_key,
)
from selfrag.infra.engine.engine_stats import EngineStats
from selfrag.infra.engine.kv_slots import KVJob, Slot, SlotPlanner
from selfrag.infra.engine.llama_batch import BatchDecoder, Feed

logger = logging.getLogger(__name__)


class PrefixStager:
    """Restores and saves the sequence states of reusable prefixes on one context."""

    def __init__(
        self,
        ctx: llama_cpp.llama_context_p,
        *,
        planner: SlotPlanner,
        decoder: BatchDecoder,
        stats: EngineStats,
        layout: ContextLayout,
    ) -> None:
        self._ctx = ctx
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._planner = planner
        self._decoder = decoder
        self._stats = stats
        self._layout = layout

    def stage(
        self,
        group_jobs: list[KVJob],
        store: PrefixStateStore,
        model_sha256: str,
        min_tokens: int,
    ) -> None:
        """Put each job's reusable prefix (of at least `min_tokens`) alone into a slot,
        restored from `store` if it can.

        Only the exact prefix computed from position 0 is ever restored or saved (a sequence's
        state holds all its tokens, so a prefix is saved while its slot holds nothing else). A
        prefix some slot already holds is left to the planner. The planner then finds each
        staged slot as a cached source and decodes only the rest of the prompt.
        """
        staged: set[int] = set()
        misses: list[tuple[Slot, PrefixKey]] = []
        feeds: list[Feed] = []
        for job in group_jobs:
            n = job.reusable
            if n < min_tokens:
                continue
            prefix = job.tokens[:n]
            holder = self._planner.holder_of(prefix)
            if holder is None:
                # Staged for decoding below: its tokens are not in the slot yet.
                holder = next((f.slot for f in feeds if f.tokens == prefix), None)
            if holder is not None:
                if holder.seq_id in staged:  # staged for an earlier job of this group
                    job.staged = n
                continue
            dest = self._planner.staging_slot(staged)
            if dest is None:
                break
            self._planner.trim(dest, 0)
            pending = sum(len(f.tokens) for f in feeds)
            if not self._planner.make_room(staged | {dest.seq_id}, pending + n):
                break
            dest.last_used = self._planner.clock
            staged.add(dest.seq_id)
            job.staged = n
            key = prefix_state_key(model_sha256, self._layout, prefix)
            state = store.get(key)
            if state is not None and self._restore(dest, prefix, state):
                self._stats.kv_restores += 1
                self._stats.kv_restored_tokens += n
                continue
            if state is None:
                self._stats.kv_misses += 1
            job.prefill += n
            self._stats.prefill_tokens += n
            misses.append((dest, key))
            feeds.append(Feed(dest, prefix, n, None))
        if feeds:
            # All missing prefixes in one batch, each alone in its sequence, so that each
            # sequence's state is exactly its prefix when saved.
            self._decoder.decode(feeds)
            for slot, key in misses:
                self._save(slot, key, store)

    def _restore(self, dest: Slot, prefix: list[int], state: bytes) -> bool:
        """Load `state` into the empty slot `dest`; False (slot left empty) if llama.cpp refuses
        it or it does not hold exactly positions 0..len(prefix)-1."""
        # A disk state is a private writable mapping: restore from it in place, uncopied.
        kind = ctypes.c_uint8 * len(state)
        writable = isinstance(state, memoryview) and not state.readonly
        buf = kind.from_buffer(state) if writable else kind.from_buffer_copy(state)
        read = llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(state), dest.seq_id)
        lo = llama_cpp.llama_memory_seq_pos_min(self._mem, dest.seq_id)
        hi = llama_cpp.llama_memory_seq_pos_max(self._mem, dest.seq_id)
        if read == len(state) and lo == 0 and hi == len(prefix) - 1:
            dest.tokens = list(prefix)
            dest.cells = self._planner.fresh_cells(len(prefix))
            return True
        llama_cpp.llama_memory_seq_rm(self._mem, dest.seq_id, 0, -1)
        self._stats.kv_restore_failures += 1
        logger.warning(
            "a stored KV state of %d tokens (%d bytes) did not restore (read %d bytes, "
            "positions %d..%d); recomputing it",
            len(prefix),
            len(state),
            read,
            lo,
            hi,
        )
        return False

    def _save(self, slot: Slot, key: PrefixKey, store: PrefixStateStore) -> None:
        """Put the state of `slot` (exactly the reusable prefix) into `store`."""
        size = llama_cpp.llama_state_seq_get_size(self._ctx, slot.seq_id)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, slot.seq_id)
        if written <= 0:
            logger.warning("llama.cpp could not save the state of sequence %d", slot.seq_id)
            return
        store.put(key, bytes(memoryview(buf)[:written]))
        self._stats.kv_saves += 1
