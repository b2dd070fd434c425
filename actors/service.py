"""The answer service of the HTTP ingress: the CLI's `SelfRAGDecoder`, reaching the other
deployments through proxies.

The decoder is synchronous, so each answer runs in a worker thread; the proxies block on
`handle.method.remote(...).result(timeout_s=...)` there while the replica's event loop keeps
serving. Every wait on another deployment is bounded by the request's deadline and ends early
when the request is abandoned (the client went away), so an admitted answer never holds its
in-flight slot past its deadline.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.metadata
import json
import logging
import threading
import time
import unicodedata
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from actors.http import (
    Answer,
    CacheStatus,
    DeadlineExceeded,
    DependencyDown,
    Overloaded,
    ServiceError,
    StepListener,
    Unprocessable,
)
from actors.metrics import Metrics, family
from pipeline.critique import Branch, LabelProbs
from pipeline.decoder import SelfRAGDecoder
from pipeline.protocols import Generation, Passage
from pipeline.ranking import Candidate, Hypothesis, StepRanking
from schemas.answer import AnswerRequest, AnswerResponse
from schemas.decoding import DecodingConfig
from schemas.settings import Settings

log = logging.getLogger("selfrag.service")

READY_PROBE_KEY = "selfrag:readyz-probe"


class QueryCache(Protocol):
    """The repeated-query cache (infra/cache.py): Redis when configured, else in-process."""

    def get(self, key: str) -> AnswerResponse | None: ...

    def put(self, key: str, response: AnswerResponse) -> None: ...


QUERY_KEY_FORMAT = 2
"""Version of the query-key layout and of the cached answer's meaning; bump it when either
changes so entries written by older code are never read as current."""

REMOTE_POLL_S = 0.2
"""How often a decoder thread blocked on a remote call looks at its cancel flag."""


@functools.cache
def package_version() -> str:
    """The installed selfrag version (part of every query key; read once per process)."""
    try:
        return importlib.metadata.version("selfrag")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "source"


def query_cache_scope(settings: Settings) -> dict[str, Any]:
    """The settings besides the request's config that change an answer: the likelihood
    critique's calibration and how passages were cut, embedded and are searched. Part of
    every query key. (The index content is the index version; secrets are left out.)"""
    r = settings.retrieval
    return {
        "calibration": settings.calibration.model_dump(mode="json"),
        "retrieval": {
            "collection": r.collection,
            "embedding_model": r.embedding_model,
            "hybrid": r.hybrid,
            "passage_words": r.passage_words,
            "passage_overlap_words": r.passage_overlap_words,
        },
    }


def query_key(
    question: str,
    config: DecodingConfig,
    index_version: str,
    model: str,
    scope: Mapping[str, Any] | None = None,
) -> str:
    """Hash of the normalised question, the effective config, the index version, the model
    (its fingerprint: id and file hash), the serving `scope` (`query_cache_scope`) and the
    code version: any change to one of them is a different answer."""
    normal = " ".join(unicodedata.normalize("NFKC", question).casefold().split())
    payload = json.dumps(
        [
            QUERY_KEY_FORMAT,
            package_version(),
            normal,
            config.model_dump(mode="json"),
            index_version,
            model,
            dict(scope or {}),
        ],
        sort_keys=True,
    )
    return "selfrag:answer:" + hashlib.sha256(payload.encode()).hexdigest()


class Cancelled(Exception):
    """The request was abandoned (client gone); the decoder thread stops waiting and ends."""


def _cancel_call(response: DeploymentResponse[Any]) -> None:
    """Best-effort cancel of an abandoned handle call (it may already have finished)."""
    try:
        response.cancel()
    except Exception as exc:
        log.debug("cancelling an abandoned call failed: %s", exc)


async def _awaited(response: DeploymentResponse[Any]) -> Any:
    """Await a handle call from the event loop; abandoning the wait cancels the call too."""
    try:
        return await response
    except asyncio.CancelledError:
        _cancel_call(response)
        raise


class _Remote:
    """Blocking calls to deployment handles from a decoder thread, each bounded by the
    request's deadline (`time.monotonic()`) and ended early by `cancel`."""

    def __init__(self, cancel: threading.Event, deadline: float, timeout_s: float) -> None:
        self._cancel = cancel
        self._deadline = deadline
        self._timeout_s = timeout_s

    def call(self, handle: DeploymentHandle, method: str, *args: Any) -> Any:
        if self._cancel.is_set():
            raise Cancelled
        response = getattr(handle, method).remote(*args)
        while True:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                self._cancel.set()
                _cancel_call(response)
                raise DeadlineExceeded(f"no answer within timeout_s={self._timeout_s:g}")
            try:
                # Short slices, so a cancelled request stops waiting within REMOTE_POLL_S.
                return response.result(timeout_s=min(remaining, REMOTE_POLL_S))
            except TimeoutError as exc:
                if isinstance(exc, RayTaskError):  # the remote code's own TimeoutError
                    raise
            if self._cancel.is_set():
                _cancel_call(response)
                raise Cancelled


class PoolCritic:
    """A `Critic` whose batched calls go to the `BranchPool` (retrieval via the
    `RetrievalDecider`), where they meet the calls of concurrent requests."""

    def __init__(
        self,
        remote: _Remote,
        pool: DeploymentHandle,
        decider: DeploymentHandle,
        source: str,
        name: str,
    ) -> None:
        self._remote = remote
        self._pool = pool
        self._decider = decider
        self._source = source
        self.name = name

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        if not branches:
            return []
        return self._remote.call(self._decider, "decide", self._source, list(branches))

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        if not branches:
            return []
        return self._remote.call(self._pool, "relevance", self._source, list(branches))

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        if not branches:
            return []
        return self._remote.call(self._pool, "draft", self._source, list(branches), max_tokens)

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        if not branches:
            return []
        return self._remote.call(self._pool, "support", self._source, list(branches), list(drafts))

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        if not branches:
            return []
        return self._remote.call(self._pool, "utility", self._source, list(branches), list(drafts))


class RemoteRetriever:
    """`pipeline.protocols.Retriever` through the `Retriever` deployment."""

    def __init__(self, remote: _Remote, handle: DeploymentHandle) -> None:
        self._remote = remote
        self._handle = handle

    def search(self, query: str, k: int) -> list[Passage]:
        return self._remote.call(self._handle, "search", query, k)


class RemoteRanker:
    """The decoder's `ranker` through the `Ranker` deployment (`pipeline.ranking.rank_step`)."""

    def __init__(self, remote: _Remote, handle: DeploymentHandle) -> None:
        self._remote = remote
        self._handle = handle

    def __call__(
        self,
        beam: Sequence[Hypothesis],
        live: Sequence[Hypothesis],
        drafted: Sequence[Candidate],
        cfg: DecodingConfig,
    ) -> StepRanking:
        return self._remote.call(self._handle, "rank", list(beam), list(live), list(drafted), cfg)


def _cause(exc: BaseException) -> BaseException:
    """The user-code exception inside a Ray task error."""
    while isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause  # type: ignore[assignment]
    return exc


def as_service_error(exc: BaseException) -> ServiceError | None:
    """The HTTP meaning of a failure raised while answering, or None if it is a bug."""
    if isinstance(exc, ServiceError):
        return exc
    cause = _cause(exc)
    if isinstance(cause, ServiceError):  # raised by a deployment (e.g. the store is down)
        return cause
    if isinstance(exc, BackPressureError) or isinstance(cause, BackPressureError):
        # A deployment's queue is full (`max_queued_requests`): shed load now, never pile up.
        return Overloaded("a deployment's request queue is full; retry later")
    if isinstance(exc, RayActorError | RayServeException):
        # A replica died or restarts (e.g. a killed BranchPool): the client retries later.
        return DependencyDown(f"a deployment is unavailable: {type(exc).__name__}")
    if isinstance(cause, RayActorError | RayServeException):
        return DependencyDown(f"a deployment is unavailable: {type(cause).__name__}")
    if isinstance(cause, ValueError):
        return Unprocessable(str(cause))
    return None


class _Admission:
    """One admitted answer's place in the in-flight count."""

    def __init__(self, service: ServeAnswerService) -> None:
        self._service = service
        self.deferred = False
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._service._inflight -= 1
            self._service._metrics.set_inflight(self._service._inflight)


class ServeAnswerService:
    """`actors.http.AnswerService` over deployment handles, with the query-cache hook:
    look up before decoding, store after."""

    def __init__(
        self,
        *,
        pool: DeploymentHandle,
        decider: DeploymentHandle,
        retriever: DeploymentHandle,
        ranker: DeploymentHandle,
        defaults: DecodingConfig,
        max_inflight: int,
        metrics: Metrics,
        cache_scope: Mapping[str, Any],
        cache: QueryCache | None = None,
        max_timeout_s: float | None = None,
        index_version_ttl_s: float = 0.0,
    ) -> None:
        """`cache_scope` is `query_cache_scope(settings)`: what besides the request decides
        an answer, so the query cache keys on it."""
        self._pool = pool
        self._decider = decider
        self._retriever = retriever
        self._ranker = ranker
        self._defaults = defaults
        self._max_inflight = max_inflight
        self._max_timeout_s = max_timeout_s
        self._inflight = 0
        self._metrics = metrics
        self._cache = cache
        self._cache_scope = dict(cache_scope)
        # A thread per admitted answer: the default executor has only cpu+4 threads.
        self._executor = ThreadPoolExecutor(max_inflight, thread_name_prefix="selfrag-decoder")
        self._model_id: str | None = None
        self._model_fingerprint: str | None = None
        self._critic_names: dict[str, str] = {}
        self._index_version_ttl_s = index_version_ttl_s
        # (version, time.monotonic() when read); a hit needs no Retriever call while it is fresh.
        self._index_version: tuple[str, float] | None = None

    @property
    def inflight(self) -> int:
        """Admitted answers whose decoder has not ended yet."""
        return self._inflight

    # --- answering -------------------------------------------------------------------------------

    async def answer(self, request: AnswerRequest, on_step: StepListener | None = None) -> Answer:
        if self._inflight >= self._max_inflight:
            self._metrics.count_overload()
            raise Overloaded(f"{self._max_inflight} answers in progress; retry later")
        self._inflight += 1
        self._metrics.set_inflight(self._inflight)
        slot = _Admission(self)
        try:
            return await self._answer(request, on_step, slot)
        except (ServiceError, asyncio.CancelledError, Cancelled):
            raise
        except Exception as exc:
            mapped = as_service_error(exc)
            if mapped is None:
                raise
            raise mapped from exc
        finally:
            if not slot.deferred:
                slot.release()

    async def _answer(
        self, request: AnswerRequest, on_step: StepListener | None, slot: _Admission
    ) -> Answer:
        config = request.config.apply_to(self._defaults)
        if self._max_timeout_s is not None and config.timeout_s > self._max_timeout_s:
            raise Unprocessable(
                f"timeout_s={config.timeout_s:g} is above this server's maximum "
                f"({self._max_timeout_s:g} s, serve.max_timeout_s)"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.timeout_s
        # The same instant on the decoder thread's clock.
        thread_deadline = time.monotonic() + config.timeout_s
        cancel = threading.Event()
        key: str | None = None
        try:
            # One deadline for everything before the answer exists: the lookups that precede
            # decoding wait on other deployments too.
            async with asyncio.timeout_at(deadline):
                model_id = await self._get_model_id()
                critic_name = await self._get_critic_name(config.critique)
                if self._cache is not None:
                    index_version = await self._get_index_version()
                    fingerprint = await self._get_model_fingerprint()
                    key = query_key(
                        request.question, config, index_version, fingerprint, self._cache_scope
                    )
                    hit = await self._cache_get(key)
                    if hit is not None:
                        if on_step is not None:
                            on_step(Hypothesis(segments=tuple(hit.segments), done=True))
                        return Answer(hit, "hit")
                remote = _Remote(cancel, thread_deadline, config.timeout_s)
                future = self._executor.submit(
                    self._decode, request.question, config, model_id, critic_name, on_step, remote
                )
                # The slot stays taken until the thread really ends, even after a 504.
                slot.deferred = True
                future.add_done_callback(lambda _: loop.call_soon_threadsafe(slot.release))
                response = await asyncio.wrap_future(future)
        except (TimeoutError, DeadlineExceeded):
            # The loop's timer or the decoder thread's own deadline check, whichever came first.
            cancel.set()
            self._metrics.count_deadline()
            raise DeadlineExceeded(f"no answer within timeout_s={config.timeout_s:g}") from None
        except asyncio.CancelledError:
            cancel.set()
            raise
        self._metrics.observe_answer(response)
        status: CacheStatus = "off"
        if self._cache is not None and key is not None:
            status = "miss" if await self._cache_put(key, response) else "error"
        return Answer(response, status)

    def _decode(
        self,
        question: str,
        config: DecodingConfig,
        model_id: str,
        critic_name: str,
        on_step: StepListener | None,
        remote: _Remote,
    ) -> AnswerResponse:
        decoder = SelfRAGDecoder(
            lambda source: PoolCritic(remote, self._pool, self._decider, source, critic_name),
            RemoteRetriever(remote, self._retriever),
            model_id,
            ranker=RemoteRanker(remote, self._ranker),
        )
        return decoder.answer(question, config, on_step)

    async def _get_model_id(self) -> str:
        if self._model_id is None:
            self._model_id = await _awaited(self._pool.model_id.remote())
        return self._model_id

    async def _get_model_fingerprint(self) -> str:
        if self._model_fingerprint is None:
            self._model_fingerprint = await _awaited(self._pool.model_fingerprint.remote())
        return self._model_fingerprint

    async def _get_index_version(self) -> str:
        now = time.monotonic()
        if self._index_version is None or now - self._index_version[1] >= self._index_version_ttl_s:
            self._index_version = (await _awaited(self._retriever.index_version.remote()), now)
        return self._index_version[0]

    async def _get_critic_name(self, source: str) -> str:
        # Also validates the source up front, so a bad one never reaches a shared batch.
        if source not in self._critic_names:
            self._critic_names[source] = await _awaited(self._pool.critic_name.remote(source))
        return self._critic_names[source]

    # --- the query cache hook --------------------------------------------------------------------

    async def _cache_get(self, key: str) -> AnswerResponse | None:
        assert self._cache is not None
        try:
            hit = await asyncio.to_thread(self._cache.get, key)
        except Exception as exc:  # a cache outage must not fail the request
            log.warning("query cache get failed, bypassing: %s", exc)
            self._metrics.count_cache("errors")
            return None
        self._metrics.count_cache("hits" if hit is not None else "misses")
        return hit

    async def _cache_put(self, key: str, response: AnswerResponse) -> bool:
        assert self._cache is not None
        try:
            await asyncio.to_thread(self._cache.put, key, response)
        except Exception as exc:
            log.warning("query cache put failed: %s", exc)
            self._metrics.count_cache("errors")
            return False
        return True

    # --- probes --------------------------------------------------------------------------------

    async def readiness(self) -> dict[str, bool]:
        async def probe(handle: DeploymentHandle, timeout_s: float) -> bool:
            try:
                return bool(await asyncio.wait_for(_awaited(handle.ready.remote()), timeout_s))
            except Exception as exc:
                log.warning("readiness: %s", exc)
                return False

        # A call to a deployment whose replica is gone waits for its replacement, so the probe's
        # timeout decides whether a restart shows as "not ready". The store answers in
        # milliseconds: 1 s. The pool may be busy with a batch of seconds: 5 s.
        model, store = await asyncio.gather(probe(self._pool, 5.0), probe(self._retriever, 1.0))
        cache = True
        if self._cache is not None:
            # A cache with a `ping` (infra.cache.AnswerCache) says whether its Redis answers;
            # its get/put never raise, so a probe get would always pass.
            ping = getattr(self._cache, "ping", None)
            try:
                if callable(ping):
                    cache = bool(await asyncio.wait_for(asyncio.to_thread(ping), 2.0))
                else:
                    await asyncio.wait_for(asyncio.to_thread(self._cache.get, READY_PROBE_KEY), 2.0)
            except Exception as exc:
                log.warning("readiness: cache: %s", exc)
                cache = False
        return {"model": model, "store": store, "cache": cache}

    async def metrics_text(self) -> list[str]:
        stats = await asyncio.wait_for(_awaited(self._pool.stats.remote()), 5.0)
        lines: list[str] = stats.render()
        counters = getattr(self._cache, "counters", None)
        if callable(counters):
            lines += family(
                "selfrag_query_cache_tier_total",
                "counter",
                "Query cache by tier: memory/redis hits, misses, Redis errors and calls bypassed "
                "while Redis is down.",
                [({"event": k}, v) for k, v in counters().items()],
            )
        return lines

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
