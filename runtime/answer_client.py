"""The answer client: one protocol for whatever answers requests, in this process, through Ray
Serve's deployments, or over a running server's HTTP API.

`AnswerClient` is what every way in holds (the CLI, the Python API, batch, evaluation, the HTTP
app, the framework adapters): a request's settled config, its answer (blocking, awaited or
streamed), retrieval without drafting, and health. Three implementations: `LocalAnswerClient`
answers in this process; `actors.http.service.ServeAnswerService` through the deployments
behind the Serve ingress; `runtime.http_client.HTTPAnswerClient` through a server's HTTP API.
The first two settle and answer along `runtime.answering.AnswerPath` (the one place a
request's config is settled), the third through its server's, and report what metrics count
to `ClientEvents` (the HTTP app's `Metrics`). `AnswerClientBase` gives an implementation whose
methods are async its blocking twins and its stream.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from selfrag.infra.home_identity import home_id
from selfrag.pipeline.decoder import StepListener
from selfrag.pipeline.protocols import Passage
from selfrag.pipeline.ranking import Hypothesis
from selfrag.runtime.answer_stream import SegmentStream, run_blocking
from selfrag.runtime.answering import (
    Answer,
    AnswerEvents,
    AnswerPath,
    CacheIdentity,
    Deadline,
    Decode,
    QueryCache,
)
from selfrag.runtime.relevance import as_passage, ranked_passages
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import DeadlineExceeded, Unprocessable
from selfrag.schemas.health import Health, ServedIndex
from selfrag.schemas.retrieval import RankedPassage, RetrievalOrder, RetrieveRequest

if TYPE_CHECKING:
    from selfrag.runtime.system import LocalRuntime

log = logging.getLogger("selfrag.answer_client")

READY_PROBE_KEY = "selfrag:readyz-probe"
PROBE_TIMEOUT_S = 5.0
"""How long a readiness probe in this process may take (a model still loading is not ready)."""
CLOSE_WAIT_S = 60.0
"""How long `close` waits for the answers still decoding to reach their next step."""


@runtime_checkable
class AnswerClient(Protocol):
    """What answers requests: every entry point holds one, in this process, through Ray
    Serve, or over HTTP. Failures are the kinds of `schemas.errors`."""

    def config(self, request: AnswerRequest) -> DecodingConfig:
        """The config `request` is answered with: its dials over the defaults, within this
        client's limits, the critique source resolved and every filter filled
        (`AnswerPath.config`). Raises `AnswerError` if refused."""
        ...

    async def aconfig(self, request: AnswerRequest) -> DecodingConfig:
        """`config` without blocking the event loop."""
        ...

    def answer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer:
        """`aanswer`, blocking this thread."""
        ...

    async def aanswer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer:
        """Answer one request; `on_step` sees the leading hypothesis after each step and may
        be called from any thread. `config`: what `config(request)` returned, when the caller
        has it (not worked out again). Cancelling the call stops the decode at its next step
        or wait."""
        ...

    def stream(self, request: AnswerRequest, config: DecodingConfig | None = None) -> SegmentStream:
        """The answer's segments as they are decoded, iterated blocking or with `async for`;
        the response is the stream's `response` once it ends."""
        ...

    def retrieve(self, request: RetrieveRequest) -> list[RankedPassage]:
        """`aretrieve`, blocking this thread."""
        ...

    async def aretrieve(self, request: RetrieveRequest) -> list[RankedPassage]:
        """The store's `top_k` passages for the query, most relevant first by the critique's
        s_rel (or in the store's order), no answer drafted; `top_k` and `critique` default
        as an answer's do (`AnswerPath.retrieval`)."""
        ...

    async def health(self) -> Health:
        """Whether each dependency (model, store, cache) answers now, and the home and
        collection answered from."""
        ...

    async def collect_metrics(self) -> None:
        """Bring what the client counts outside the metrics (e.g. the query cache's tier
        counters) into them, before `/metrics` renders them."""
        ...

    def close(self) -> None:
        """Stop what this client runs (answers in flight, connections)."""
        ...


class AnswerClientBase(ABC):
    """An `AnswerClient` made of its async methods: the blocking twins run them on an event
    loop of their own, and `stream` streams `aanswer`."""

    @abstractmethod
    async def aconfig(self, request: AnswerRequest) -> DecodingConfig: ...

    @abstractmethod
    async def aanswer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer: ...

    @abstractmethod
    async def aretrieve(self, request: RetrieveRequest) -> list[RankedPassage]: ...

    @abstractmethod
    async def health(self) -> Health: ...

    def config(self, request: AnswerRequest) -> DecodingConfig:
        return run_blocking(lambda: self.aconfig(request))

    def answer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer:
        return run_blocking(lambda: self.aanswer(request, on_step, config))

    def stream(self, request: AnswerRequest, config: DecodingConfig | None = None) -> SegmentStream:
        return SegmentStream(self.aanswer, request, config)

    def retrieve(self, request: RetrieveRequest) -> list[RankedPassage]:
        return run_blocking(lambda: self.aretrieve(request))

    async def collect_metrics(self) -> None:
        """Nothing to collect (a client whose metrics are elsewhere)."""
        return None

    def close(self) -> None:
        """Nothing to stop (a client that holds nothing open between calls)."""
        return None


class ClientPassages:
    """`pipeline.protocols.PassageSearch` over an answer client's retrieval in the store's
    order (nothing read): the passages the client's store finds, for a pipeline part that
    searches (the evaluation's vanilla RAG)."""

    def __init__(self, client: AnswerClient, collection: str | None = None) -> None:
        self._client = client
        self._collection = collection

    def search(self, query: str, k: int) -> list[Passage]:
        request = RetrieveRequest(
            query=query, top_k=k, order="retriever", collection=self._collection
        )
        return [as_passage(p) for p in self._client.retrieve(request)]

    def search_many(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        return [self.search(q, k) for q in queries]


class ClientEvents(AnswerEvents, Protocol):
    """What an answer client reports besides its path's cache and deadline events (the HTTP
    app's `Metrics`)."""

    def observe_answer(self, r: AnswerResponse) -> None:
        """A freshly decoded answer (not a cache hit)."""
        ...

    def set_inflight(self, n: int) -> None:
        """Answers whose decode still runs."""
        ...

    def sync_query_cache(self, counters: Mapping[str, int]) -> None:
        """The query cache's tier counters, as they are now."""
        ...


def report_cache_counters(cache: QueryCache | None, events: ClientEvents) -> None:
    """The query cache's tier counters (`infra.cache.tiers` `counters()`, where it has them)
    into `events`."""
    counters = getattr(cache, "counters", None)
    if callable(counters):
        events.sync_query_cache(counters())


def query_cache_ready(cache: QueryCache | None) -> bool:
    """Whether the query cache answers: its `ping` when it has one (`infra.cache.tiers`: whether
    its Redis answers; its get/put never raise, so a probe get would always pass), else a get.
    No cache is ready."""
    if cache is None:
        return True
    ping = getattr(cache, "ping", None)
    if callable(ping):
        return bool(ping())
    cache.get(READY_PROBE_KEY)
    return True


async def probe(check: Callable[[], bool], timeout_s: float, name: str) -> bool:
    """`check` in a thread within `timeout_s`; a failure or a timeout is not ready (logged)."""
    try:
        return bool(await asyncio.wait_for(asyncio.to_thread(check), timeout_s))
    except Exception as exc:
        log.warning("readiness: %s: %r", name, exc)
        return False


Retrieve = Callable[[str, DecodingConfig, RetrievalOrder], list[RankedPassage]]
"""`retrieve(query, config, order)`: the config's `top_k` passages, ranked by the relevance
read of its critique source, or in the store's order (`runtime.relevance.ranked_passages`)."""


@dataclass(frozen=True)
class AnswerSite:
    """Where one collection's answers are made in this process: its answer path, how to
    decode, the cache identity (asked only when answers are cached), and how to retrieve."""

    path: AnswerPath
    decode: Decode
    identity: Callable[[], CacheIdentity] | None = None
    retrieve: Retrieve | None = None


class LocalAnswerClient:
    """`AnswerClient` in this process: each request along its collection's `AnswerSite`. The
    blocking methods run in the caller's thread (the Python API, batch actors, evaluation);
    the async ones in a worker thread for an event loop (the HTTP app without Serve). With
    `events` it reports what the Serve ingress reports: its path's cache lookups and
    deadlines, each decoded answer, the answers in flight and the cache's tier counters."""

    def __init__(
        self,
        site: Callable[[str | None], AnswerSite],
        *,
        probes: Mapping[str, Callable[[], bool]] | None = None,
        events: ClientEvents | None = None,
        served: Callable[[], ServedIndex] | None = None,
    ) -> None:
        """`site(collection)`: where a request on `collection` (None: the configured one) is
        answered. `probes`: readiness checks by dependency name (the query cache's is added).
        `served`: the home and collection answered from, for `health`."""
        self._site = site
        self._probes = dict(probes or {})
        self._events = events
        self._served = served
        self._idle = threading.Condition()
        self._running: set[Deadline] = set()

    @classmethod
    def for_runtime(
        cls, runtime: LocalRuntime, *, events: ClientEvents | None = None
    ) -> LocalAnswerClient:
        """Answers with `runtime`'s engine, store and answer path (on any collection of its
        home); ready when its model tokenizes and its store answers."""
        settings = runtime.settings
        return cls(
            lambda collection: runtime_site(runtime.for_collection(collection)),
            probes={
                "model": lambda: bool(runtime.engine.tokenize("ready")),
                "store": lambda: runtime.store.ready(),
            },
            events=events,
            served=lambda: ServedIndex(
                home_id=home_id(settings.home), collection=settings.retrieval.collection
            ),
        )

    def reporting(self, events: ClientEvents) -> LocalAnswerClient:
        """A client answering as this one does (its sites and probes) that reports to
        `events`. The two share their answers in flight: those are counted together, and
        `stop` on either cancels them all."""
        client = LocalAnswerClient(
            self._site, probes=self._probes, events=events, served=self._served
        )
        client._idle, client._running = self._idle, self._running
        return client

    def config(self, request: AnswerRequest) -> DecodingConfig:
        return self._site(request.collection).path.config(request)

    async def aconfig(self, request: AnswerRequest) -> DecodingConfig:
        # In a thread: settling may calibrate a missing threshold first (minutes).
        return await asyncio.to_thread(self.config, request)

    def answer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
        deadline: Deadline | None = None,
    ) -> Answer:
        """Answer `request` in this thread. `config`: a settled config (`config(request)`, or
        the batch driver's). The decode stops at its next step once `deadline` (default: one
        of `timeout_s`, from the path, which counts its expiry) is cancelled or expired by
        whoever waits, or `stop` cancels it; an unexpired one the decoder keeps to itself."""
        site = self._site(request.collection)
        path = self._path(site)
        if config is None:
            config = path.config(request)
        deadline = deadline if deadline is not None else path.deadline(config.timeout_s)
        with self._in_flight(deadline):
            answer = path.run(
                request.question,
                config,
                site.decode,
                identity=site.identity,
                deadline=deadline,
                on_step=functools.partial(_checked_step, deadline, on_step),
            )
        if self._events is not None and answer.cache != "hit":
            self._events.observe_answer(answer.response)
        return answer

    async def aanswer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer:
        if config is None:
            config = await self.aconfig(request)
        deadline = await asyncio.to_thread(self._deadline, request, config)
        try:
            async with asyncio.timeout(config.timeout_s):
                return await asyncio.to_thread(self.answer, request, on_step, config, deadline)
        except TimeoutError:
            deadline.expire()
            raise DeadlineExceeded(f"no answer within timeout_s={config.timeout_s:g}") from None
        except asyncio.CancelledError:
            deadline.cancel()  # the decode thread stops at its next step
            raise

    def stream(self, request: AnswerRequest, config: DecodingConfig | None = None) -> SegmentStream:
        return SegmentStream(self.aanswer, request, config)

    def retrieve(self, request: RetrieveRequest) -> list[RankedPassage]:
        site = self._site(request.collection)
        if site.retrieve is None:
            raise Unprocessable("this answer client does not retrieve without drafting")
        return site.retrieve(request.query, site.path.retrieval(request), request.order)

    async def aretrieve(self, request: RetrieveRequest) -> list[RankedPassage]:
        return await asyncio.to_thread(self.retrieve, request)

    def _path(self, site: AnswerSite) -> AnswerPath:
        """`site`'s answer path, reporting to this client's events."""
        return site.path if self._events is None else site.path.reporting(self._events)

    def _deadline(self, request: AnswerRequest, config: DecodingConfig) -> Deadline:
        """A deadline for `request` whose expiry this client counts (`AnswerPath.deadline`)."""
        return self._path(self._site(request.collection)).deadline(config.timeout_s)

    @contextmanager
    def _in_flight(self, deadline: Deadline) -> Iterator[None]:
        """One answer decoding: counted (and reported) until it ends, `stop` can cancel it."""
        with self._idle:
            self._running.add(deadline)
            self._report_inflight()
        try:
            yield
        finally:
            with self._idle:
                self._running.discard(deadline)
                self._report_inflight()
                self._idle.notify_all()

    def _report_inflight(self) -> None:
        if self._events is not None:
            self._events.set_inflight(len(self._running))

    def stop(self, wait_s: float) -> bool:
        """Cancel every answer in flight (each decode ends at its next step) and wait up to
        `wait_s` for them to end; whether none is left."""
        with self._idle:
            for deadline in self._running:
                deadline.cancel()
            return self._idle.wait_for(lambda: not self._running, wait_s)

    def close(self) -> None:
        """`stop` the answers in flight, waiting up to `CLOSE_WAIT_S` for them."""
        self.stop(CLOSE_WAIT_S)

    async def health(self) -> Health:
        cache = self._site(None).path.cache
        checks = {**self._probes, "cache": functools.partial(query_cache_ready, cache)}
        results = await asyncio.gather(
            *(probe(check, PROBE_TIMEOUT_S, name) for name, check in checks.items())
        )
        served = await asyncio.to_thread(self._served) if self._served is not None else None
        return Health.of(dict(zip(checks, results, strict=True)), served)

    async def collect_metrics(self) -> None:
        """The query cache's tier counters into `events` (nothing without them)."""
        if self._events is not None:
            cache = self._site(None).path.cache
            await asyncio.to_thread(report_cache_counters, cache, self._events)


def runtime_site(runtime: LocalRuntime) -> AnswerSite:
    """`runtime`'s answer path, decoding and retrieving in this process, keyed by its index
    and model."""

    def retrieve(query: str, config: DecodingConfig, order: RetrievalOrder) -> list[RankedPassage]:
        relevance = runtime.critic(config.critique).relevance if order == "relevance" else None
        return ranked_passages(query, runtime.store, config.top_k, relevance)

    return AnswerSite(runtime.answer_path, runtime.decode, runtime.cache_identity, retrieve)


def _checked_step(deadline: Deadline, on_step: StepListener | None, h: Hypothesis) -> None:
    """A step of a decode with `deadline`: ends it once the deadline was cancelled or expired
    by whoever waits for it; an unexpired one the decoder keeps to itself."""
    if deadline.cancelled:
        deadline.check()
    if on_step is not None:
        on_step(h)
