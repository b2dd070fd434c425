"""`pipeline.protocols.PassageSearch` through a remote `PassageService`: Serve's `Retriever`
deployment (the ingress) or the batch jobs' store actor. One adapter over one bounded call: the
caller supplies `call(method, *args)`, which waits within the answer's `Deadline`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from selfrag.pipeline.protocols import Passage
from selfrag.runtime.answering import Deadline

log = logging.getLogger(__name__)

RemoteCall = Callable[..., Any]
"""`call(method, *args)`: one call to a remote `PassageService`, bounded by a deadline."""

POLL_S = 0.2
"""How often a thread blocked on a remote call looks at its deadline's cancel flag."""


class RemoteRetriever:
    """`search`, `search_many` and `index_version` of a remote `PassageService`."""

    def __init__(self, call: RemoteCall) -> None:
        self._call = call

    def search(self, query: str, k: int) -> list[Passage]:
        return self._call("search", query, k)  # type: ignore[no-any-return]

    def search_many(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        return self._call("search_many", list(queries), k)  # type: ignore[no-any-return]

    def index_version(self) -> str:
        return self._call("index_version")  # type: ignore[no-any-return]


def actor_call(handle: Any, deadline: Deadline, *, poll_s: float = POLL_S) -> RemoteCall:
    """Calls to a Ray actor `handle` that wait at most until `deadline` (and stop waiting within
    `poll_s` of it being cancelled), raising its `DeadlineExceeded` or `Cancelled`; the remote
    code's own errors come back as raised there (Ray's task error is also their class)."""

    def call(method: str, *args: Any) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError

        deadline.check()
        ref = getattr(handle, method).remote(*args)
        while True:
            remaining = deadline.remaining()
            if remaining > 0 and not deadline.cancelled:
                try:
                    return ray.get(ref, timeout=min(remaining, poll_s))
                except GetTimeoutError:
                    continue
            try:
                ray.cancel(ref)  # drops it if it has not started (a running call finishes)
            except Exception as exc:
                log.debug("cancelling an abandoned actor call failed: %s", exc)
            deadline.check()  # raises: the deadline passed, or the answer was abandoned

    return call
