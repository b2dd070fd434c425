"""The answer service of the HTTP ingress: the CLI's `SelfRAGDecoder`, reaching the other
deployments through proxies.

The decoder is synchronous, so each answer runs in a worker thread; the proxies block on
`handle.method.remote(...).result()` there while the replica's event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import unicodedata
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle

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

log = logging.getLogger("selfrag.service")

READY_PROBE_KEY = "selfrag:readyz-probe"


class QueryCache(Protocol):
    """The repeated-query cache (infra/cache.py): Redis when configured, else in-process."""

    def get(self, key: str) -> AnswerResponse | None: ...

    def put(self, key: str, response: AnswerResponse) -> None: ...


def query_key(question: str, config: DecodingConfig, index_version: str, model_id: str) -> str:
    """Hash of the normalised question, the effective config, the index version and the model:
    any change to one of them is a different answer."""
    normal = " ".join(unicodedata.normalize("NFKC", question).casefold().split())
    payload = json.dumps(
        [normal, config.model_dump(mode="json"), index_version, model_id], sort_keys=True
    )
    return "selfrag:answer:" + hashlib.sha256(payload.encode()).hexdigest()


class Cancelled(Exception):
    """The request was abandoned (deadline or client gone); stop at the next remote call."""


class _Remote:
    """Blocking calls to deployment handles from a decoder thread, honouring cancellation."""

    def __init__(self, cancel: threading.Event) -> None:
        self._cancel = cancel

    def call(self, handle: DeploymentHandle, method: str, *args: Any) -> Any:
        if self._cancel.is_set():
            raise Cancelled
        return getattr(handle, method).remote(*args).result()


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
        cache: QueryCache | None = None,
        max_timeout_s: float | None = None,
        index_version_ttl_s: float = 0.0,
    ) -> None:
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
        # A thread per admitted answer: the default executor has only cpu+4 threads.
        self._executor = ThreadPoolExecutor(max_inflight, thread_name_prefix="selfrag-decoder")
        self._model_id: str | None = None
        self._critic_names: dict[str, str] = {}
        self._index_version_ttl_s = index_version_ttl_s
        # (version, time.monotonic() when read); a hit needs no Retriever call while it is fresh.
        self._index_version: tuple[str, float] | None = None

    # --- answering -------------------------------------------------------------------------------

    async def answer(self, request: AnswerRequest, on_step: StepListener | None = None) -> Answer:
        if self._inflight >= self._max_inflight:
            self._metrics.count_overload()
            raise Overloaded(f"{self._max_inflight} answers in progress; retry later")
        self._inflight += 1
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
                    key = query_key(request.question, config, index_version, model_id)
                    hit = await self._cache_get(key)
                    if hit is not None:
                        if on_step is not None:
                            on_step(Hypothesis(segments=tuple(hit.segments), done=True))
                        return Answer(hit, "hit")
                future = self._executor.submit(
                    self._decode, request.question, config, model_id, critic_name, on_step, cancel
                )
                # The slot stays taken until the thread really ends, even after a 504.
                slot.deferred = True
                future.add_done_callback(lambda _: loop.call_soon_threadsafe(slot.release))
                response = await asyncio.wrap_future(future)
        except TimeoutError:
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
        cancel: threading.Event,
    ) -> AnswerResponse:
        remote = _Remote(cancel)
        decoder = SelfRAGDecoder(
            lambda source: PoolCritic(remote, self._pool, self._decider, source, critic_name),
            RemoteRetriever(remote, self._retriever),
            model_id,
            ranker=RemoteRanker(remote, self._ranker),
        )
        return decoder.answer(question, config, on_step)

    async def _get_model_id(self) -> str:
        if self._model_id is None:
            self._model_id = await self._pool.model_id.remote()
        return self._model_id

    async def _get_index_version(self) -> str:
        now = time.monotonic()
        if self._index_version is None or now - self._index_version[1] >= self._index_version_ttl_s:
            self._index_version = (await self._retriever.index_version.remote(), now)
        return self._index_version[0]

    async def _get_critic_name(self, source: str) -> str:
        # Also validates the source up front, so a bad one never reaches a shared batch.
        if source not in self._critic_names:
            self._critic_names[source] = await self._pool.critic_name.remote(source)
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
                return bool(await asyncio.wait_for(handle.ready.remote(), timeout_s))
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
        stats = await asyncio.wait_for(self._pool.stats.remote(), 5.0)
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
