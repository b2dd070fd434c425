"""The answer client of the Serve ingress (`ServeAnswerService`): the CLI's `BeamDecoder`,
reaching the other deployments through proxies.

The decoder is synchronous, so each answer runs in a worker thread; the proxies block on
`handle.method.remote(...).result(timeout_s=...)` there while the replica's event loop keeps
serving. Every wait on another deployment is bounded by the request's deadline and ends early
when the request is abandoned (the client went away), so an admitted answer never holds its
in-flight slot past its deadline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle

from selfrag.actors.http.deployment_calls import (
    PoolBranchWorker,
    RemoteCalls,
    RemoteRanker,
    awaited,
)
from selfrag.actors.http.metrics import Metrics
from selfrag.pipeline.decoder import StepListener
from selfrag.runtime.answer_client import (
    AnswerClientBase,
    probe,
    query_cache_ready,
    report_cache_counters,
)
from selfrag.runtime.answering import (
    Answer,
    AnswerPath,
    CacheIdentity,
    Deadline,
    KnownCritique,
)
from selfrag.runtime.assembly import DecoderParts
from selfrag.runtime.relevance import ranked_passages
from selfrag.runtime.remote_retriever import RemoteRetriever
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.documents import DocumentInfo, Removal
from selfrag.schemas.errors import (
    AnswerError,
    DeadlineExceeded,
    DependencyDown,
    Overloaded,
    Unprocessable,
)
from selfrag.schemas.health import Health, ServedIndex
from selfrag.schemas.retrieval import RankedPassage, RetrieveRequest

log = logging.getLogger("selfrag.service")


def _cause(exc: BaseException) -> BaseException:
    """The user-code exception inside a Ray task error."""
    while isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause  # type: ignore[assignment]
    return exc


class InternalFailure(RuntimeError):
    """A failure without a meaning for the client (a bug, or a fault of a deployment): a
    generic 500 whose cause goes to the log. Not a ValueError, so that the answer path does
    not take it for a request it cannot answer."""


def as_service_error(exc: BaseException) -> AnswerError | None:
    """The HTTP meaning of a failure raised while answering, or None if it is a bug. A
    deployment's ValueError is one too: what a client may not ask for is refused where the
    request is checked (`AnswerPath.config`, the pool's `critic_name`), as an AnswerError;
    its raw message may name internals."""
    if isinstance(exc, AnswerError):
        return exc
    cause = _cause(exc)
    if isinstance(cause, AnswerError):  # raised by a deployment (e.g. the store is down)
        return cause
    if isinstance(exc, BackPressureError) or isinstance(cause, BackPressureError):
        # A deployment's queue is full (`max_queued_requests`): shed load now, never pile up.
        return Overloaded("a deployment's request queue is full; retry later")
    if isinstance(exc, RayActorError | RayServeException):
        # A replica died or restarts (e.g. a killed BranchPool): the client retries later.
        return DependencyDown(f"a deployment is unavailable: {type(exc).__name__}")
    if isinstance(cause, RayActorError | RayServeException):
        return DependencyDown(f"a deployment is unavailable: {type(cause).__name__}")
    return None


@contextmanager
def service_errors() -> Iterator[None]:
    """Failures with a known meaning raised as `AnswerError`s; anything else (a bug) as is,
    but a ValueError as an `InternalFailure` (never a 422 with its raw message)."""
    try:
        yield
    except (AnswerError, asyncio.CancelledError, InternalFailure):
        raise
    except Exception as exc:
        mapped = as_service_error(exc)
        if mapped is not None:
            raise mapped from exc
        if isinstance(exc, ValueError):  # a Ray task error is an instance of its cause's class
            raise InternalFailure(f"{type(_cause(exc)).__name__} while answering") from exc
        raise


class _InflightCount:
    """Admitted answers whose decoder has not ended, at most `limit`; admitted on the event loop,
    released from any thread (a decoder outliving its request's 504)."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self.value = 0
        self._lock = threading.Lock()
        self._metrics = metrics

    def admit(self) -> _Admission | None:
        """A place in the count, or None when every one is taken."""
        with self._lock:
            if self.value >= self.limit:
                return None
            self.value += 1
            self._metrics.set_inflight(self.value)
        return _Admission(self)

    def give_back(self) -> None:
        with self._lock:
            self.value -= 1
            self._metrics.set_inflight(self.value)


class _Admission:
    """One admitted answer's place in the in-flight count, given back once, from any thread."""

    def __init__(self, count: _InflightCount) -> None:
        self._count = count
        self.deferred = False
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._count.give_back()


class ServeAnswerService(AnswerClientBase):
    """`runtime.answer_client.AnswerClient` over deployment handles: the answer path
    (`AnswerPath`: settled config, query cache, deadline, error kinds) decoding through the
    pool, settling with the pool's critique facts (fetched once per source)."""

    def __init__(
        self,
        *,
        pool: DeploymentHandle,
        decider: DeploymentHandle,
        retriever: DeploymentHandle,
        ranker: DeploymentHandle,
        path: AnswerPath,
        max_inflight: int,
        metrics: Metrics,
        index_version_ttl_s: float = 0.0,
        affinity: bool = True,
        collection: str | None = None,
    ) -> None:
        """`path` is the deployment's `AnswerPath.for_settings` (its events: `metrics`). With
        `affinity` every call of one answer carries the same session id (the pool and decider
        route by it)."""
        self._affinity = affinity
        self._collection = collection
        self._pool = pool
        self._decider = decider
        self._retriever = retriever
        self._ranker = ranker
        self._path = path
        self._cache = path.cache
        self._inflight = _InflightCount(max_inflight, metrics)
        self._draining = False
        self._metrics = metrics
        # A thread per admitted answer: the default executor has only cpu+4 threads.
        self._executor = ThreadPoolExecutor(max_inflight, thread_name_prefix="selfrag-decoder")
        self._model_id: str | None = None
        self._model_fingerprint: str | None = None
        self._critic_names: dict[str, str] = {}
        self._calibrated: dict[str, dict[str, object]] = {}
        self._index_version_ttl_s = index_version_ttl_s
        # (version, time.monotonic() when read); a hit needs no Retriever call while it is fresh.
        self._index_version: tuple[str, float] | None = None
        self._served: ServedIndex | None = None

    @property
    def inflight(self) -> int:
        """Admitted answers whose decoder has not ended yet."""
        return self._inflight.value

    def drain(self) -> int:
        """Admit no more answers (each is a 503 with Retry-After: the server is stopping) and
        return how many admitted ones are still running; `selfrag serve` calls it on a stop
        until that is 0 or its grace period ends."""
        self._draining = True
        return self._inflight.value

    # --- answering -------------------------------------------------------------------------------

    async def aconfig(self, request: AnswerRequest) -> DecodingConfig:
        """The settled config of `request` (`AnswerPath.requested`, then `settle` with the
        pool's facts)."""
        self._check_collection(request)
        with service_errors():
            return await self._settled(self._path.requested(request))

    async def _settled(self, config: DecodingConfig) -> DecodingConfig:
        """`config` settled with the pool's facts of its critique source."""
        name = await self._get_critic_name(config.critique)
        calibrated = await self._get_calibrated(name)
        return self._path.settle(config, KnownCritique(config.critique, name, calibrated))

    def _check_collection(self, request: AnswerRequest | RetrieveRequest) -> None:
        """A server answers from the one collection its Retriever serves: another is a 422."""
        if request.collection not in (None, self._collection):
            raise Unprocessable(
                f"collection {request.collection!r}: this server answers from "
                f"{self._collection!r} only (start one with --collection NAME for another, or "
                "use the CLI or the Python API, which answer from any collection of the home)"
            )

    async def aanswer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer:
        self._check_collection(request)
        if self._draining:
            raise Overloaded("the server is stopping; retry in a moment")
        slot = self._inflight.admit()
        if slot is None:
            self._metrics.count_overload()
            raise Overloaded(f"{self._inflight.limit} answers in progress; retry later")
        try:
            with service_errors():
                return await self._answer(request, on_step, slot, config)
        finally:
            if not slot.deferred:
                slot.release()
            self.collect_metrics_now()  # so Ray's export has the cache tiers without a scrape

    async def _answer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None,
        slot: _Admission,
        requested: DecodingConfig | None,
    ) -> Answer:
        config = requested if requested is not None else self._path.requested(request)
        loop = asyncio.get_running_loop()
        # One deadline for everything before the answer exists: the lookups that precede
        # decoding wait on other deployments too. The loop's timer and the decoder thread's
        # own checks share it; whichever sees it pass first ends the answer (and is the one
        # that counts it).
        deadline = self._path.deadline(config.timeout_s)
        try:
            async with asyncio.timeout_at(loop.time() + config.timeout_s):
                model_id = await self._get_model_id()
                config = await self._settled(config)  # a settled one settles to itself
                identity: CacheIdentity | None = None
                if self._cache is not None:
                    identity = CacheIdentity(
                        await self._get_index_version(), await self._get_model_fingerprint()
                    )
                decode = functools.partial(self._decode, model_id)
                future = self._executor.submit(
                    self._path.run,
                    request.question,
                    config,
                    decode,
                    identity=(lambda: identity) if identity is not None else None,
                    deadline=deadline,
                    on_step=on_step,
                )
                # The slot stays taken until the thread really ends, even after a 504. It is
                # freed from that thread: the loop may be gone by then (a blocking `answer` runs
                # an answer on a loop of its own, closed once the answer is cancelled).
                slot.deferred = True
                future.add_done_callback(lambda _: slot.release())
                answer = await asyncio.wrap_future(future)
        except TimeoutError:
            deadline.expire()  # counted unless the decoder thread saw it pass first
            raise DeadlineExceeded(f"no answer within timeout_s={config.timeout_s:g}") from None
        except asyncio.CancelledError:
            deadline.cancel()
            raise
        if answer.cache != "hit":
            self._metrics.observe_answer(answer.response)
        return answer

    def _decode(
        self,
        model_id: str,
        question: str,
        config: DecodingConfig,
        deadline: Deadline,
        on_step: StepListener | None,
    ) -> AnswerResponse:
        remote = RemoteCalls(deadline, self._metrics)
        pool, decider = self._pool, self._decider
        if self._affinity:
            # One session per answer: all its steps reach the same pool and decider replicas.
            session = uuid.uuid4().hex
            pool = pool.options(session_id=session)
            decider = decider.options(session_id=session)
        parts = DecoderParts(
            # A settled config names the concrete source: the pool's critic is that one.
            lambda source: PoolBranchWorker(remote, pool, decider, source, source, deadline),
            RemoteRetriever(functools.partial(remote.call, self._retriever)),
            model_id,
            ranker=RemoteRanker(remote, self._ranker),
        )
        with service_errors():
            return parts.decode(question, config, on_step)

    async def _get_model_id(self) -> str:
        if self._model_id is None:
            self._model_id = await awaited(self._pool.model_id.remote())
        return self._model_id

    async def _get_model_fingerprint(self) -> str:
        if self._model_fingerprint is None:
            self._model_fingerprint = await awaited(self._pool.model_fingerprint.remote())
        return self._model_fingerprint

    async def _get_index_version(self) -> str:
        now = time.monotonic()
        if self._index_version is None or now - self._index_version[1] >= self._index_version_ttl_s:
            self._index_version = (await awaited(self._retriever.index_version.remote()), now)
        return self._index_version[0]

    async def _get_critic_name(self, source: str) -> str:
        # Also validates the source up front, so a bad one never reaches a shared batch.
        if source not in self._critic_names:
            self._critic_names[source] = await awaited(self._pool.critic_name.remote(source))
        return self._critic_names[source]

    async def _get_calibrated(self, critic_name: str) -> dict[str, object]:
        # The pool's calibrated filter defaults of the source, read once per ingress (as the
        # pool reads its calibration once per replica: a new one needs a restart).
        if critic_name not in self._calibrated:
            self._calibrated[critic_name] = await awaited(
                self._pool.calibrated_filters.remote(critic_name)
            )
        return self._calibrated[critic_name]

    # --- retrieval -------------------------------------------------------------------------------

    async def aretrieve(self, request: RetrieveRequest) -> list[RankedPassage]:
        """The Retriever's passages for the query, read for relevance on the pool (one call
        each), within the config's `timeout_s`."""
        self._check_collection(request)
        source = request.critique or self._path.defaults.critique
        with service_errors():
            name = await self._get_critic_name(source)
        config = self._path.retrieval(request, KnownCritique(source, name, {}))
        deadline = self._path.deadline(config.timeout_s)
        try:
            async with asyncio.timeout(config.timeout_s):
                future = self._executor.submit(
                    self._retrieve, request.query, config, request.order == "relevance", deadline
                )
                return await asyncio.wrap_future(future)
        except TimeoutError:
            deadline.expire()
            raise DeadlineExceeded(f"no passages within timeout_s={config.timeout_s:g}") from None
        except asyncio.CancelledError:
            deadline.cancel()
            raise

    def _retrieve(
        self, query: str, config: DecodingConfig, read: bool, deadline: Deadline
    ) -> list[RankedPassage]:
        remote = RemoteCalls(deadline, self._metrics)
        search = RemoteRetriever(functools.partial(remote.call, self._retriever))

        def relevance(branches: object) -> list[object]:
            return remote.call(  # type: ignore[no-any-return]
                self._pool, "relevance", config.critique, list(branches), deadline.remaining()
            )

        with service_errors():
            return ranked_passages(query, search, config.top_k, relevance if read else None)

    # --- probes --------------------------------------------------------------------------------

    # --- documents -------------------------------------------------------------------------------

    async def documents(self) -> list[DocumentInfo]:
        """The indexed documents (the Retriever's store)."""
        with service_errors():
            return await awaited(self._retriever.documents.remote())  # type: ignore[no-any-return]

    async def remove(self, refs: list[str]) -> Removal:
        """Remove documents; the next answer reads the new index version (no cached answer
        citing them is served)."""
        with service_errors():
            removal: Removal = await awaited(self._retriever.remove.remote(refs))
        self._index_version = None
        return removal

    async def health(self) -> Health:
        async def ready(handle: DeploymentHandle, timeout_s: float) -> bool:
            try:
                return bool(await asyncio.wait_for(awaited(handle.ready.remote()), timeout_s))
            except Exception as exc:
                log.warning("readiness: %s", exc)
                return False

        # A call to a deployment whose replica is gone waits for its replacement, so the probe's
        # timeout decides whether a restart shows as "not ready". The store answers in
        # milliseconds: 1 s. The pool may be busy with a batch of seconds: 5 s. An answer needs
        # both engines, the pool's and the decider's: "model" is both.
        pool, decider, store = await asyncio.gather(
            ready(self._pool, 5.0), ready(self._decider, 5.0), ready(self._retriever, 1.0)
        )
        model = pool and decider
        cache = await probe(functools.partial(query_cache_ready, self._cache), 2.0, "cache")
        checks = {"model": model, "store": store, "cache": cache}
        return Health.of(checks, await self._get_served())

    async def _get_served(self) -> ServedIndex | None:
        """The home and collection the Retriever serves (asked once); None while it does not
        answer."""
        if self._served is None:
            try:
                served = await asyncio.wait_for(awaited(self._retriever.served.remote()), 2.0)
            except Exception as exc:
                log.warning("the Retriever did not say what it serves: %r", exc)
                return None
            self._served = ServedIndex.model_validate(served)
        return self._served

    async def collect_metrics(self) -> None:
        """Before a scrape: the query cache's tier counters, as they are now. (The engine
        replicas' batch sizes reach Prometheus through Ray's metrics export, from every
        replica; this process does not ask them.)"""
        self.collect_metrics_now()

    def collect_metrics_now(self) -> None:
        """`collect_metrics` from synchronous code."""
        report_cache_counters(self._cache, self._metrics)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
