"""How many threads each `llama_decode` call runs on, chosen by measuring calls of its size.

A small call (a generation step of a few sequences, a short prompt extension) is often faster
on one thread than on all of them: ggml meets its threads at a barrier after every operation,
several hundred times per call, and with OpenMP's passive wait each meeting wakes a sleeping
thread. On a 2-core machine (notes/benchmarks.md, "Threads per call") the generation steps of
a small model ran faster on one thread than on two while a prompt ran faster on two; a larger
model gained from one thread only at one-sequence steps. Where the crossing lies depends on the
model, the CPU and the load from other
processes, so it is measured here, per call size, while the engine works. Only where the
crossing may lie is measured: a class larger than one that all threads won, or smaller than one
that one thread won, follows it unmeasured (more tokens per call only favour more threads), so
a rare long call is not tried on one thread at up to twice its cost. The thread count
can change the last digits of a score (llama.cpp splits some sums by thread), as the batch
shape already does.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

CHOSEN_MAX_TOKENS = 64
"""Calls of more tokens always run on all threads (prompt prefill, where all threads win)."""


def size_class(n_tokens: int) -> int:
    """Calls of up to 8 tokens are classed by their exact size, longer ones by powers of 2."""
    return n_tokens if n_tokens <= 8 else 8 + (n_tokens - 1).bit_length() - 3


@dataclass
class _Estimate:
    """The median of the last `keep` calls: one slow call (a page fault, a neighbour's burst,
    the first call after the thread count changed) does not decide."""

    keep: int
    recent: deque[float] = field(default_factory=deque)
    samples: int = 0

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        if len(self.recent) > self.keep:
            self.recent.popleft()
        self.samples += 1

    @property
    def seconds(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0


@dataclass
class ThreadChooser:
    """The thread count of each call: all `threads`, or one where one thread has measured
    faster for calls of that size.

    Each size class keeps the median seconds of the last `keep` calls of each candidate. Until
    every candidate has `warmup` samples the least sampled one runs; after that the faster
    one, except that every `recheck`-th call of a class runs the other, so a change of load
    (another process taking a core) is noticed within a few dozen calls. A class not yet
    measured on both follows a smaller measured class that all threads won, or a larger one
    that one thread won.
    """

    threads: int
    adaptive: bool = True
    """False: every call runs on all `threads`."""
    warmup: int = 3
    recheck: int = 32
    keep: int = 5
    _estimates: dict[tuple[tuple[int, bool], int], _Estimate] = field(default_factory=dict)
    _calls: dict[tuple[int, bool], int] = field(default_factory=dict)

    @property
    def candidates(self) -> tuple[int, ...]:
        return (1, self.threads) if self._chooses else (self.threads,)

    @property
    def _chooses(self) -> bool:
        return self.adaptive and self.threads > 1

    def choose(self, n_tokens: int, *, reads: bool = False) -> int:
        """The thread count for a call of `n_tokens` tokens; `reads`: it also outputs hidden
        states or middle blocks, which costs more, so such calls are classed apart."""
        if not self._chooses or n_tokens > CHOSEN_MAX_TOKENS:
            return self.threads
        cls = (size_class(n_tokens), reads)
        own = self._settled(cls)
        if own is None:
            bound = self._bound(cls)
            if bound is not None:
                return bound
        calls = self._calls.get(cls, 0)
        self._calls[cls] = calls + 1
        estimates = [self._estimates.get((cls, t), _Estimate(self.keep)) for t in self.candidates]
        least = min(range(len(estimates)), key=lambda i: estimates[i].samples)
        if own is None:
            return self.candidates[least]
        if calls % self.recheck == self.recheck - 1:
            return self.threads if own == 1 else 1
        return own

    def _settled(self, cls: tuple[int, bool]) -> int | None:
        """The faster thread count of `cls` once each candidate has `warmup` samples."""
        est = [self._estimates.get((cls, t)) for t in self.candidates]
        if any(e is None or e.samples < self.warmup for e in est):
            return None
        return self.candidates[min(range(len(est)), key=lambda i: est[i].seconds)]  # type: ignore[union-attr]

    def _bound(self, cls: tuple[int, bool]) -> int | None:
        """All threads where a smaller class of the same kind settled on them, one where a
        larger one settled on one; None where no measured class says, or two disagree."""
        size, reads = cls
        says: set[int] = set()
        for other in {c for c, _ in self._estimates if c[1] == reads and c[0] != size}:
            won = self._settled(other)
            if (won == self.threads and other[0] < size) or (won == 1 and other[0] > size):
                says.add(won)
        return says.pop() if len(says) == 1 else None

    def record(self, n_tokens: int, threads: int, seconds: float, *, reads: bool = False) -> None:
        """What a call of `n_tokens` tokens on `threads` threads took."""
        if not self._chooses or n_tokens > CHOSEN_MAX_TOKENS:
            return
        key = ((size_class(n_tokens), reads), threads)
        self._estimates.setdefault(key, _Estimate(self.keep)).add(seconds)

    def chosen(self) -> dict[int, int]:
        """The thread count each measured size class of plain calls (no hidden states) runs
        on now (smallest size of the class → threads), for stats and benchmarks."""
        out: dict[int, int] = {}
        for cls in sorted({c for c, _ in self._estimates if not c[1]}):
            won = self._settled(cls)
            if won is not None:
                out[_smallest(cls[0])] = won
        return out


def _smallest(cls: int) -> int:
    return cls if cls <= 8 else 2 ** (cls - 8 + 2) + 1
