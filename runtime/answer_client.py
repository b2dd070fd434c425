"""The answer client: one protocol for whatever answers requests, in this process or through
Ray Serve's deployments.

`AnswerClient` is what every way in talks to: answer a request (and stream its steps through
`on_step`), the config it is answered with, and readiness. `LocalAnswerClient` answers in this
process (the Python API, batch actors, evaluation, and the HTTP app without Serve);
`actors.http.service.ServeAnswerService` answers through the deployments behind the Serve
ingress. Both answer along `runtime.answering.AnswerPath`, the one place a request's config is
settled, and report what metrics count to `ClientEvents` (the HTTP app's `Metrics`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from selfrag.pipeline.decoder import StepListener
from selfrag.pipeline.ranking import Hypothesis
from selfrag.runtime.answering import (
    Answer,
    AnswerEvents,
    AnswerPath,
    CacheIdentity,
    Deadline,
    Decode,
    QueryCache,
)
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import DeadlineExceeded

if TYPE_CHECKING:
    from selfrag.runtime.system import LocalRuntime

log = logging.getLogger("selfrag.answer_client")

READY_PROBE_KEY = "selfrag:readyz-probe"
PROBE_TIMEOUT_S = 5.0
"""How long a readiness probe in this process may take (a model still loading is not ready)."""


@runtime_checkable
class AnswerClient(Protocol):
    """What answers requests: the HTTP app, the Python API, batch and evaluation talk to one."""

    def config(self, request: AnswerRequest) -> DecodingConfig:
        """The config `request` is answered with: its dials over the defaults, within this
        client's limits, settled (`AnswerPath.config`) where the critique facts are at hand,
        else settled by `run` (the Serve ingress fetches them from the pool). Raises
        `AnswerError` if refused."""
        ...

    async def run(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer:
        """Answer one request along the answer path; `on_step` sees the leading hypothesis
        after each step and may be called from any thread. `config`: what `config(request)`
        returned, when the caller has it (not worked out again). Cancelling the call stops
        the decode at its next step or wait."""
        ...

    async def readiness(self) -> dict[str, bool]:
        """Each dependency (model, store, cache) and whether it answers now."""
        ...

    async def collect_metrics(self) -> None:
        """Bring what the client counts outside the metrics (e.g. the query cache's tier
        counters) into them, before `/metrics` renders them."""
        ...


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


@dataclass(frozen=True)
class AnswerSite:
    """Where one collection's answers are made in this process: its answer path, how to
    decode, and the cache identity (asked only when answers are cached)."""

    path: AnswerPath
    decode: Decode
    identity: Callable[[], CacheIdentity] | None = None


class LocalAnswerClient:
    """`AnswerClient` in this process: each request along its collection's `AnswerSite`. The
    blocking `answer` is for callers in threads (the Python API, batch actors, evaluation);
    `run` answers in a worker thread for an event loop (the HTTP app without Serve). With
    `events` it reports what the Serve ingress reports: its path's cache lookups and
    deadlines, each decoded answer, the answers in flight and the cache's tier counters."""

    def __init__(
        self,
        site: Callable[[str | None], AnswerSite],
        *,
        probes: Mapping[str, Callable[[], bool]] | None = None,
        events: ClientEvents | None = None,
    ) -> None:
        """`site(collection)`: where a request on `collection` (None: the configured one) is
        answered. `probes`: readiness checks by dependency name (the query cache's is added)."""
        self._site = site
        self._probes = dict(probes or {})
        self._events = events
        self._idle = threading.Condition()
        self._running: set[Deadline] = set()

    @classmethod
    def for_runtime(
        cls, runtime: LocalRuntime, *, events: ClientEvents | None = None
    ) -> LocalAnswerClient:
        """Answers with `runtime`'s engine, store and answer path (on any collection of its
        home); ready when its model tokenizes and its store answers."""
        return cls(
            lambda collection: runtime_site(runtime.for_collection(collection)),
            probes={
                "model": lambda: bool(runtime.engine.tokenize("ready")),
                "store": lambda: runtime.store.ready(),
            },
            events=events,
        )

    def reporting(self, events: ClientEvents) -> LocalAnswerClient:
        """A client answering as this one does (its sites and probes) that reports to
        `events`. The two share their answers in flight: those are counted together, and
        `stop` on either cancels them all."""
        client = LocalAnswerClient(self._site, probes=self._probes, events=events)
        client._idle, client._running = self._idle, self._running
        return client

    def config(self, request: AnswerRequest) -> DecodingConfig:
        return self._site(request.collection).path.config(request)

    def answer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
        deadline: Deadline | None = None,
    ) -> Answer:
        """Answer `request`, blocking. `config`: a settled config (`config(request)`, or the
        batch driver's). The decode stops at its next step once `deadline` (default: one of
        `timeout_s`, from the path, which counts its expiry) is cancelled or expired by whoever
        waits, or `stop` cancels it; an unexpired one the decoder keeps to itself."""
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

    async def run(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer:
        if config is None:
            config = await asyncio.to_thread(self.config, request)
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

    async def readiness(self) -> dict[str, bool]:
        cache = self._site(None).path.cache
        checks = {**self._probes, "cache": functools.partial(query_cache_ready, cache)}
        results = await asyncio.gather(
            *(probe(check, PROBE_TIMEOUT_S, name) for name, check in checks.items())
        )
        return dict(zip(checks, results, strict=True))

    async def collect_metrics(self) -> None:
        """The query cache's tier counters into `events` (nothing without them)."""
        if self._events is not None:
            cache = self._site(None).path.cache
            await asyncio.to_thread(report_cache_counters, cache, self._events)


def runtime_site(runtime: LocalRuntime) -> AnswerSite:
    """`runtime`'s answer path, decoding in this process, keyed by its index and model."""
    return AnswerSite(runtime.answer_path, runtime.decode, runtime.cache_identity)


def _checked_step(deadline: Deadline, on_step: StepListener | None, h: Hypothesis) -> None:
    """A step of a decode with `deadline`: ends it once the deadline was cancelled or expired
    by whoever waits for it; an unexpired one the decoder keeps to itself."""
    if deadline.cancelled:
        deadline.check()
    if on_step is not None:
        on_step(h)
