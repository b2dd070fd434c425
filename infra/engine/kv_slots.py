"""Which KV-cache sequence ("slot") holds which tokens: the llama.cpp engine's slot planner.

One context holds up to `n_seq_max` sequences in a unified KV cache of `n_ctx` cells. The
planner remembers what every slot holds, so a request that extends an earlier prompt decodes
only its new tokens; it groups a call's requests so that each group fits the cache, gives every
request a slot with the longest cached prefix available to it, shares a group's common prefix
(one decode, then `seq_cp`), and evicts least recently used slots to make room. It changes the
cache only through `KVMemory`, so it is tested without a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class KVMemory(Protocol):
    """The KV-cache operations the planner needs (llama.cpp's `llama_memory_*`)."""

    def seq_cp(self, src: int, dest: int, length: int) -> None:
        """Let sequence `dest` share the cells of positions 0..length-1 of `src`."""
        ...

    def seq_rm(self, seq: int, n_keep: int) -> None:
        """Drop positions n_keep.. of sequence `seq` (raising when that fails)."""
        ...

    def clear(self) -> None:
        """Drop every sequence."""
        ...


@dataclass
class Slot:
    """What one sequence id holds in the KV cache.

    `cells` names the KV cells behind `tokens` (ids invented here). llama.cpp's unified cache
    frees a cell once no sequence uses it and `seq_cp` shares cells, so the number of distinct
    ids over all slots is exactly the number of occupied cells.
    """

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    cells: list[int] = field(default_factory=list)
    last_used: int = -1


@dataclass
class KVJob:
    """One request as KV work: `tokens` must be in the slot, with logits at `out_from`.."""

    tokens: list[int]
    reuse_limit: int
    """At most this many leading tokens may come from the cache: logits are needed after them."""
    out_from: int
    reserve: int = 0
    """KV cells the job needs after its prefill (tokens it may generate)."""
    reusable: int = 0
    """Leading tokens whose KV state may come from, and go to, the prefix-state store."""
    staged: int = 0
    """Leading tokens placed in a slot before planning (restored or decoded alone to save)."""
    hidden: bool = False
    """The final hidden state is wanted with the logits at `out_from`."""
    layers: tuple[int, ...] = ()
    """Middle blocks whose outputs are wanted with the logits at `out_from`."""
    last_alone: bool = False
    """Decode the last prompt token in a call of its own (with the other jobs' last tokens)."""
    prefill: int = 0
    slot: Slot | None = None


@dataclass
class Plan:
    """How a group of jobs uses the KV cache; indices are positions in the group."""

    root: int
    """The job whose slot decodes the shared prefix (-1: nothing is copied)."""
    copies: list[int]
    """Jobs that receive the shared prefix from the root by seq_cp."""
    cached: list[int]
    """Leading tokens each job's slot already holds from earlier calls."""
    starts: list[int]
    """Position from which each job's own tokens are decoded."""
    new_cells: int


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of `a` and `b`, at most `limit` (binary search on slices)."""
    hi = min(len(a), len(b), limit)
    if hi <= 0 or a[0] != b[0]:
        return 0
    if list(a[:hi]) == list(b[:hi]):
        return hi
    lo = 0  # a[:lo] == b[:lo] holds, a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class SlotPlanner:
    """The slots of one context and the decisions about them; `clock` counts engine calls
    (for least-recently-used eviction)."""

    def __init__(
        self,
        memory: KVMemory,
        *,
        n_ctx: int,
        n_seq_max: int,
        prefix_cache: bool = True,
        share_prefix: bool = True,
    ) -> None:
        self._memory = memory
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.prefix_cache = prefix_cache
        self.share_prefix = share_prefix
        self.slots = [Slot(seq_id=i) for i in range(n_seq_max)]
        self.clock = 0
        self._next_cell = 0

    def tick(self) -> None:
        """A new engine call begins."""
        self.clock += 1

    def fresh_cells(self, n: int) -> list[int]:
        """Ids for `n` newly written KV cells."""
        cells = list(range(self._next_cell, self._next_cell + n))
        self._next_cell += n
        return cells

    def shared_prefix(self, group_jobs: Sequence[KVJob]) -> int:
        """The prefix every job of a group may take from one decode (0 when not sharing)."""
        if not self.share_prefix or len(group_jobs) < 2:
            return 0
        shared = min(job.reuse_limit for job in group_jobs)
        first = group_jobs[0].tokens
        for job in group_jobs[1:]:
            shared = common_prefix(first, job.tokens, shared)
        return shared

    def holder_of(self, prefix: Sequence[int]) -> Slot | None:
        """A slot whose content starts with all of `prefix`."""
        n = len(prefix)
        return next((s for s in self.slots if common_prefix(s.tokens, prefix, n) == n), None)

    def groups(self, active: list[int], jobs: list[KVJob]) -> list[list[int]]:
        """Split jobs, in order, into groups of at most n_seq_max whose cells fit the KV cache.

        A group needs at most its shared prefix once plus every job's own rest and reserve;
        cells held by other slots can always be evicted, so this bound is safe.
        """
        groups: list[list[int]] = []
        current: list[int] = []
        prefix = 0
        rest = 0
        for i in active:
            job = jobs[i]
            if current:
                new_prefix = prefix
                if self.share_prefix:
                    new_prefix = common_prefix(
                        jobs[current[0]].tokens, job.tokens, min(prefix, job.reuse_limit)
                    )
                else:
                    new_prefix = 0
                # Shrinking the shared prefix moves its lost part into every member's own rest.
                need = new_prefix + rest + (prefix - new_prefix) * len(current)
                need += len(job.tokens) - new_prefix + job.reserve
                if len(current) < self.n_seq_max and need <= self.n_ctx:
                    rest += (prefix - new_prefix) * len(current) + len(job.tokens) - new_prefix
                    rest += job.reserve
                    prefix = new_prefix
                    current.append(i)
                    continue
                groups.append(current)
            current = [i]
            prefix = job.reuse_limit if self.share_prefix else 0
            rest = len(job.tokens) - prefix + job.reserve
        if current:
            groups.append(current)
        return groups

    def place(self, group_jobs: list[KVJob], shared: int) -> Plan | None:
        """Give every job its own slot holding the longest cached prefix available to it.

        A job's prefix may sit in any slot (the source). When the job extends the source's
        whole content, the source becomes the job's slot; otherwise the prefix is copied into an
        empty or least recently used slot (seq_cp is free in a unified cache), so the source
        keeps its longer content for later calls. Only when no such slot is left is a source
        trimmed. Then slots not used by this group are evicted, least recently used first,
        until the group's new cells fit. Returns None when they do not fit even so.
        """
        sources, cached, root = self._sources(group_jobs, shared)
        dests = self._destinations(sources, cached)
        n = len(group_jobs)
        taken = {d.seq_id for d in dests}

        # Copy first: a later trim may shorten a slot that another job copies from.
        for k in range(n):
            src, dest = sources[k], dests[k]
            if src is not None and src is not dest:
                self.copy_prefix(src, dest, cached[k])
                src.last_used = self.clock
        for k in range(n):
            dest = dests[k]
            self.trim(dest, cached[k])
            dest.last_used = self.clock
            group_jobs[k].slot = dest

        copies: list[int] = []
        if shared:
            copies = [k for k in range(n) if k != root and cached[k] < shared]
        starts = [shared if k in copies else cached[k] for k in range(n)]
        if copies:
            starts[root] = max(cached[root], shared)
        else:
            root = -1
        new_cells = sum(
            len(j.tokens) - start + j.reserve for j, start in zip(group_jobs, starts, strict=True)
        )
        if root >= 0:
            new_cells += max(shared - cached[root], 0)
        if not self.make_room(taken, new_cells):
            return None
        return Plan(root=root, copies=copies, cached=cached, starts=starts, new_cells=new_cells)

    def _sources(
        self, group_jobs: list[KVJob], shared: int
    ) -> tuple[list[Slot | None], list[int], int]:
        """Per job, the slot holding its longest usable cached prefix (ties: the most recently
        used) and that length; and the job that will decode the shared prefix (the root, -1
        without one), whose copies make shorter caches of the others useless."""
        n = len(group_jobs)
        sources: list[Slot | None] = [None] * n
        cached = [0] * n
        if self.prefix_cache:
            for k, job in enumerate(group_jobs):
                for slot in self.slots:
                    length = common_prefix(slot.tokens, job.tokens, job.reuse_limit)
                    best = sources[k]
                    if length > cached[k] or (
                        length and length == cached[k] and best and slot.last_used > best.last_used
                    ):
                        sources[k], cached[k] = slot, length
        root = -1
        if shared:
            root = max(range(n), key=lambda k: cached[k])
            for k in range(n):
                # The root will hold the shared prefix and copy it: a shorter cache is useless.
                if k != root and cached[k] <= shared:
                    sources[k], cached[k] = None, 0
        return sources, cached, root

    def _destinations(self, sources: list[Slot | None], cached: list[int]) -> list[Slot]:
        """Each job's own slot: its source when the job extends all of it, else an empty or
        least recently used slot no job copies from, else (none left) its source, trimmed, or
        any slot not taken (its cache then unused: `sources` and `cached` are updated)."""
        n = len(sources)
        dests: list[Slot | None] = [None] * n
        taken: set[int] = set()
        order = sorted(range(n), key=lambda k: -cached[k])
        for k in order:
            src = sources[k]
            if src and src.seq_id not in taken and cached[k] == len(src.tokens):
                dests[k] = src
                taken.add(src.seq_id)
        reserved = {src.seq_id for src in sources if src}
        free = sorted(
            (s for s in self.slots if s.seq_id not in reserved and s.seq_id not in taken),
            key=lambda s: (bool(s.tokens), s.last_used),
        )
        for k in order:
            if dests[k] is None and free:
                dests[k] = free.pop(0)
                taken.add(dests[k].seq_id)
        for k in order:
            if dests[k] is not None:
                continue
            src = sources[k]
            if src and src.seq_id not in taken:
                dests[k] = src
            else:
                # Only slots that other jobs copy from are left: take one, cache unused.
                dests[k] = next(s for s in self.slots if s.seq_id not in taken)
                sources[k], cached[k] = None, 0
            taken.add(dests[k].seq_id)
        assert all(d is not None for d in dests)
        return dests  # type: ignore[return-value]

    def make_room(self, keep: set[int], new_cells: int) -> bool:
        """Evict slots not in `keep` (least recently used first) until `new_cells` cells are free.

        Returns False, having evicted every other slot, when they still do not fit.
        """
        kept: set[int] = set()
        for seq_id in keep:
            kept.update(self.slots[seq_id].cells)
        others = sorted(
            (s for s in self.slots if s.seq_id not in keep and s.tokens),
            key=lambda s: s.last_used,
        )
        while True:
            live = set(kept)
            for slot in others:
                live.update(slot.cells)
            if len(live) + new_cells <= self.n_ctx:
                return True
            if not others:
                return False
            self.trim(others.pop(0), 0)

    def copy_prefix(self, src: Slot, dest: Slot, length: int) -> None:
        """Make `dest` hold the first `length` tokens of `src`, sharing its KV cells."""
        self.trim(dest, 0)
        if length:
            self._memory.seq_cp(src.seq_id, dest.seq_id, length)
        dest.tokens = src.tokens[:length]
        dest.cells = src.cells[:length]

    def staging_slot(self, taken: set[int]) -> Slot | None:
        """An empty slot, else the least recently used one, outside `taken`."""
        free = [s for s in self.slots if s.seq_id not in taken]
        if not free:
            return None
        return min(free, key=lambda s: (bool(s.tokens), s.last_used))

    def trim(self, slot: Slot, n_keep: int) -> None:
        """Drop everything in `slot` from position `n_keep` on."""
        if len(slot.tokens) > n_keep:
            self._memory.seq_rm(slot.seq_id, n_keep)
            del slot.tokens[n_keep:]
            del slot.cells[n_keep:]

    def clear(self) -> None:
        """Forget every slot's content (and the cells behind it)."""
        self._memory.clear()
        for slot in self.slots:
            slot.tokens = []
            slot.cells = []
            slot.last_used = -1
