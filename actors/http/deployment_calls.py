"""How the Serve ingress reaches the other deployments from a decoder thread: blocking handle
calls bounded by the request's deadline (`RemoteCalls`), and the decoder's branch worker and
ranker made of them."""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Sequence
from typing import Any

from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from selfrag.actors.http.metrics import Metrics
from selfrag.pipeline.branching import StepWork
from selfrag.pipeline.critics import Branch, LabelProbs
from selfrag.pipeline.ranking import Candidate, Drafted, Hypothesis, StepRanking
from selfrag.runtime.answering import Deadline
from selfrag.runtime.remote_retriever import POLL_S
from selfrag.schemas.decoding import DecodingConfig

log = logging.getLogger("selfrag.service")


def _cancel_call(response: DeploymentResponse[Any]) -> None:
    """Best-effort cancel of an abandoned handle call (it may already have finished)."""
    try:
        response.cancel()
    except Exception as exc:
        log.debug("cancelling an abandoned call failed: %s", exc)


async def awaited(response: DeploymentResponse[Any]) -> Any:
    """Await a handle call from the event loop; abandoning the wait cancels the call too."""
    try:
        return await response
    except asyncio.CancelledError:
        _cancel_call(response)
        raise


class RemoteCalls:
    """Blocking calls to deployment handles from a decoder thread, each bounded by the
    request's `Deadline` and ended early when it is cancelled; each counted in `metrics` with
    the pickled size of what it moved."""

    def __init__(self, deadline: Deadline, metrics: Metrics) -> None:
        self._deadline = deadline
        self._metrics = metrics

    def call(self, handle: DeploymentHandle, method: str, *args: Any) -> Any:
        self._deadline.check()
        response = getattr(handle, method).remote(*args)
        result = self._wait(response)
        self._metrics.count_remote(
            str(getattr(handle, "deployment_name", "?")),
            method,
            len(pickle.dumps(args, protocol=5)),
            len(pickle.dumps(result, protocol=5)),
        )
        return result

    def _wait(self, response: DeploymentResponse[Any]) -> Any:
        while True:
            remaining = self._deadline.remaining()
            if remaining > 0:
                try:
                    # Short slices, so a cancelled request stops waiting within POLL_S.
                    return response.result(timeout_s=min(remaining, POLL_S))
                except TimeoutError as exc:
                    if isinstance(exc, RayTaskError):  # the remote code's own TimeoutError
                        raise
            if remaining <= 0 or self._deadline.cancelled:
                _cancel_call(response)
                self._deadline.check()


class PoolBranchWorker:
    """The decoder's `BranchWorker` in the ingress: the retrieval decision goes to the
    `RetrievalDecider`, a step's branch work to the `BranchPool`, one call each per step,
    each with what is left of the request's deadline."""

    def __init__(
        self,
        remote: RemoteCalls,
        pool: DeploymentHandle,
        decider: DeploymentHandle,
        source: str,
        name: str,
        deadline: Deadline,
    ) -> None:
        self._remote = remote
        self._pool = pool
        self._decider = decider
        self._source = source
        self._deadline = deadline
        self.name = name

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        if not branches:
            return []
        return self._remote.call(
            self._decider, "decide", self._source, list(branches), self._deadline.remaining()
        )

    def expand(self, candidates: Sequence[Candidate], cfg: DecodingConfig) -> StepWork:
        return self._remote.call(
            self._pool, "expand", self._source, list(candidates), cfg, self._deadline.remaining()
        )


class RemoteRanker:
    """The decoder's `ranker` through the `Ranker` deployment (`pipeline.ranking.rank_step`)."""

    def __init__(self, remote: RemoteCalls, handle: DeploymentHandle) -> None:
        self._remote = remote
        self._handle = handle

    def __call__(
        self,
        beam: Sequence[Hypothesis],
        live: Sequence[Hypothesis],
        drafted: Sequence[Drafted],
        cfg: DecodingConfig,
    ) -> StepRanking:
        return self._remote.call(self._handle, "rank", list(beam), list(live), list(drafted), cfg)
