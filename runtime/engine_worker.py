"""One engine in this process and the merger of its concurrent answers' critique calls: what a
Serve pool or decider replica and a batch actor each hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from selfrag.runtime.answering import Deadline
from selfrag.runtime.merging import CallMerger, MergedCritic
from selfrag.runtime.system import LocalRuntime
from selfrag.schemas.settings import Settings

_T = TypeVar("_T")


class EngineWorker:
    """The process's `LocalRuntime` (its engine loaded now: never fork after this) and one
    `CallMerger`. Each answer runs `run` in a thread of its own; its critique calls merge with
    the other threads' into multi-sequence engine calls and stop at the answer's deadline."""

    def __init__(
        self,
        settings: Settings,
        *,
        merge_wait_s: float,
        max_calls: int | None = None,
        on_batch: Callable[[str, int, int], None] | None = None,
    ) -> None:
        self.rag = LocalRuntime(settings)
        self.engine = self.rag.engine
        self._merger = CallMerger(
            self.rag.critic, merge_wait_s, max_calls=max_calls, on_batch=on_batch
        )

    def critic_name(self, source: str) -> str:
        """The critique source `source` resolves to (`CritiqueUnavailable` when this model
        cannot run it)."""
        return self.rag.critic(source).name

    def run(self, source: str, deadline: Deadline, work: Callable[[MergedCritic], _T]) -> _T:
        """`work` on the critique `source`, its calls merged with the other threads' ones."""
        name = self.critic_name(source)  # checked before any engine work
        self._merger.enter()
        try:
            return work(MergedCritic(self._merger, source, name, deadline))
        finally:
            self._merger.leave()
