"""One merger of critique calls across concurrent answers, for every engine process.

A batch actor decodes many questions in threads, and a branch pool replica serves many
requests' steps at once; either way each thread's critique calls (relevance, draft, support,
utility, retrieval) go through one `CallMerger`, which turns the calls pending together into
one multi-sequence engine call. A call waits until every active thread has a call pending (or
`max_wait_s` passed); while the engine runs, new calls queue and are merged into the next one.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from selfrag.pipeline.critics import Branch, Critic, LabelProbs
from selfrag.pipeline.protocols import Generation
from selfrag.runtime.answering import Deadline


@dataclass
class _Entry:
    key: tuple[str, str, int | None]
    branches: list[Branch]
    drafts: list[Generation] | None
    since: float
    done: bool = False
    result: list[Any] | None = None
    error: BaseException | None = None


class CallMerger:
    """One engine call at a time for all decoder threads of an actor. A call waits until every
    running decoder has a call pending (or `max_wait_s` passed), then all pending calls with the
    oldest call's (method, critique source, max_tokens) run as one batch of branches."""

    def __init__(
        self,
        critic_for: Callable[[str], Critic],
        max_wait_s: float,
        *,
        max_calls: int | None = None,
        on_batch: Callable[[str, int, int], None] | None = None,
    ) -> None:
        """`max_calls` caps the calls merged into one engine call; `on_batch` sees (method,
        calls merged, branches) of every engine call."""
        self._critic_for = critic_for
        self._max_wait_s = max_wait_s
        self._max_calls = max_calls
        self._on_batch = on_batch
        self._cond = threading.Condition()
        self._pending: list[_Entry] = []
        self._busy = False
        self._active = 0
        self.engine_calls = 0
        self.merged_branches = 0

    def enter(self) -> None:
        with self._cond:
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()  # the others may be waiting for this decoder

    def call(
        self,
        method: str,
        source: str,
        branches: Sequence[Branch],
        drafts: Sequence[Generation] | None = None,
        max_tokens: int | None = None,
    ) -> list[Any]:
        entry = _Entry(
            (method, source, max_tokens),
            list(branches),
            list(drafts) if drafts is not None else None,
            time.monotonic(),
        )
        with self._cond:
            self._pending.append(entry)
            self._cond.notify_all()
        while True:
            with self._cond:
                group = self._wait_for_turn(entry)
            if group is None:
                break
            self._execute(group)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        if entry.error is not None:
            raise entry.error
        assert entry.result is not None
        return entry.result

    def _wait_for_turn(self, entry: _Entry) -> list[_Entry] | None:
        """Under the lock: None once `entry` is done, else the group this thread must run."""
        while not entry.done:
            if not self._busy and self._pending:
                waited = time.monotonic() - self._pending[0].since
                if len(self._pending) >= self._active or waited >= self._max_wait_s:
                    key = self._pending[0].key
                    group = [e for e in self._pending if e.key == key][: self._max_calls]
                    taken = {id(e) for e in group}
                    self._pending = [e for e in self._pending if id(e) not in taken]
                    self._busy = True
                    return group
                self._cond.wait(self._max_wait_s - waited)
            else:
                self._cond.wait()
        return None

    def _execute(self, group: list[_Entry]) -> None:
        try:
            outputs = self._engine_call(group)
        except Exception:
            if len(group) == 1:
                group[0].error = sys.exc_info()[1]
                group[0].done = True
                return
            # One bad request must not fail its neighbours: run each alone.
            for e in group:
                self._execute([e])
            return
        start = 0
        for e in group:
            e.result = outputs[start : start + len(e.branches)]
            e.done = True
            start += len(e.branches)

    def _engine_call(self, group: list[_Entry]) -> list[Any]:
        method, source, max_tokens = group[0].key
        critic = self._critic_for(source)
        branches = [b for e in group for b in e.branches]
        self.engine_calls += 1
        self.merged_branches += len(branches)
        if self._on_batch is not None:
            self._on_batch(method, len(group), len(branches))
        if method == "draft":
            assert max_tokens is not None
            return critic.draft(branches, max_tokens)
        if method in ("support", "utility"):
            drafts = [d for e in group for d in (e.drafts or [])]
            return list(getattr(critic, method)(branches, drafts))
        return list(getattr(critic, method)(branches))


class MergedCritic:
    """The `Critic` one decoder thread sees: its calls go through the process's `CallMerger`,
    and each first checks the answer's `Deadline`."""

    def __init__(self, merger: CallMerger, source: str, name: str, deadline: Deadline) -> None:
        self._merger = merger
        self._source = source
        self._deadline = deadline
        self.name = name

    def _call(self, method: str, branches: Sequence[Branch], *rest: Any) -> list[Any]:
        self._deadline.check()  # an expired question stops at its next critique call
        if not branches:
            return []
        return self._merger.call(method, self._source, branches, *rest)

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        return self._call("retrieval", branches)

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        return self._call("relevance", branches)

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        return self._call("draft", branches, None, max_tokens)

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        return self._call("support", branches, drafts)

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        return self._call("utility", branches, drafts)
