"""The one answer path, shared by the CLI, the HTTP ingress, batch jobs and evaluation.

`AnswerPath` owns what every entry point would otherwise decide for itself: the settled config
(the configured defaults under a request's dials, the critique source resolved and its unset
filters filled, before anything is keyed or decoded), the query-cache key and its get/put (a
cache outage never fails an answer), the deadline and cancellation (`Deadline`), and the error
kinds (`selfrag.schemas.errors`). Entry points only supply how to decode (local engine, the
Serve pool, a batch actor's merged calls) and translate its errors into exit codes, HTTP
statuses or error records.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import json
import logging
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from selfrag.pipeline.critics import CritiqueUnavailable, settle_filters
from selfrag.pipeline.decoder import StepListener
from selfrag.pipeline.ranking import Hypothesis
from selfrag.schemas.answer import AnswerRequest, AnswerResponse, SegmentOut
from selfrag.schemas.decoding import DecodingConfig, DecodingOverrides
from selfrag.schemas.errors import AnswerError, Cancelled, DeadlineExceeded, Unprocessable
from selfrag.schemas.events import SegmentEvent
from selfrag.schemas.retrieval import RetrieveRequest
from selfrag.schemas.settings import Settings

log = logging.getLogger("selfrag.answering")

CacheStatus = Literal["hit", "miss", "off", "error"]

QUERY_KEY_FORMAT = 3
"""Version of the query-key layout and of the cached answer's meaning; bump it when either
changes so entries written by older code are never read as current."""


class QueryCache(Protocol):
    """The repeated-query cache (infra/cache/tiers.py): Redis when configured, else in-process."""

    def get(self, key: str) -> AnswerResponse | None: ...

    def put(self, key: str, response: AnswerResponse) -> None: ...


class CritiqueFacts(Protocol):
    """What a deployment knows of its critique sources, to settle a config with."""

    def critique_name(self, source: str) -> str:
        """The concrete source `source` stands for on this model (`auto` resolved, as
        `pipeline.critics.factory.auto_source` decides); `CritiqueUnavailable` when none."""
        ...

    def calibrated_filters(self, name: str) -> Mapping[str, object]:
        """The filter defaults calibrated on the served corpus for the source `name`."""
        ...


@dataclass(frozen=True)
class KnownCritique:
    """`CritiqueFacts` fetched already for one requested source (the Serve ingress asks the
    pool for them)."""

    source: str
    name: str
    calibrated: Mapping[str, object]

    def critique_name(self, source: str) -> str:
        if source not in (self.source, self.name):
            raise ValueError(f"facts for critique {self.source!r}, asked for {source!r}")
        return self.name

    def calibrated_filters(self, name: str) -> Mapping[str, object]:
        return self.calibrated if name == self.name else {}


class AnswerEvents(Protocol):
    """Where the path reports what metrics count (the ingress's `Metrics`)."""

    def count_cache(self, event: str) -> None: ...

    def count_deadline(self) -> None: ...


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
            "fusion": r.fusion,
            "chunking": r.chunking,
            "passage_tokens": r.passage_tokens,
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


class Deadline:
    """When an answer must be done (`time.monotonic()`), and whether it was abandoned. Whoever
    waits on the answer's behalf (a remote call, a merged engine call) calls `check` between
    waits, so an expired or abandoned answer stops at its next wait."""

    def __init__(
        self,
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_expire: Callable[[], None] | None = None,
    ) -> None:
        """`on_expire` runs once, at the first expiry, whichever thread sees it."""
        self.timeout_s = timeout_s
        self._clock = clock
        self.at = clock() + timeout_s
        self._cancelled = threading.Event()
        self._expired = False
        self._on_expire = on_expire
        self._lock = threading.Lock()

    def remaining(self) -> float:
        return self.at - self._clock()

    def cancel(self) -> None:
        """The caller went away (or gave up): every later `check` raises `Cancelled`."""
        self._cancelled.set()

    def expire(self) -> None:
        """The time is up (the caller's own timer, or a check): later checks raise
        `DeadlineExceeded`. Both the waiter and the decode may see it; `on_expire` runs for
        the first only."""
        with self._lock:
            first = not self._expired
            self._expired = True
        self._cancelled.set()
        if first and self._on_expire is not None:
            self._on_expire()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check(self) -> None:
        if self._expired or self.remaining() <= 0:
            self.expire()
            raise DeadlineExceeded(f"no answer within timeout_s={self.timeout_s:g}")
        if self._cancelled.is_set():
            raise Cancelled("the request was abandoned")


Decode = Callable[[str, DecodingConfig, Deadline, StepListener | None], AnswerResponse]


class LeaderSegments:
    """Turns the leading hypothesis of each step into the segment events a stream sends:
    from the first segment that changed since the last step (index i replaces any segment with
    index ≥ i sent before, since the beam's leader can change)."""

    def __init__(self) -> None:
        self._sent: list[SegmentOut] = []

    def events(self, h: Hypothesis) -> list[SegmentEvent]:
        segments = list(h.segments)
        start = 0
        while start < min(len(self._sent), len(segments)) and self._sent[start] == segments[start]:
            start += 1
        self._sent[:] = segments
        return [
            SegmentEvent(index=i, segment=segments[i], hypothesis_score=h.score)
            for i in range(start, len(segments))
        ]


@dataclass(frozen=True)
class Answer:
    response: AnswerResponse
    cache: CacheStatus


@dataclass(frozen=True)
class CacheIdentity:
    """What, besides the question and its config, names an answer in the query cache."""

    index_version: str
    model_fingerprint: str


class AnswerPath:
    """Settled config, query cache, deadline and error kinds around one way of decoding."""

    def __init__(
        self,
        defaults: DecodingConfig,
        *,
        facts: CritiqueFacts | None = None,
        cache: QueryCache | None = None,
        cache_scope: Mapping[str, Any] | None = None,
        max_timeout_s: float | None = None,
        events: AnswerEvents | None = None,
    ) -> None:
        self.defaults = defaults
        self._facts = facts
        self.cache = cache
        self._scope = dict(cache_scope or {})
        self._max_timeout_s = max_timeout_s
        self._events = events

    @classmethod
    def for_settings(
        cls,
        settings: Settings,
        *,
        facts: CritiqueFacts | None = None,
        max_timeout_s: float | None = None,
        events: AnswerEvents | None = None,
    ) -> AnswerPath:
        """The answer path of a deployment: its configured defaults, its critique `facts`, and
        the query cache (none when `cache.query` is off) keyed with the deployment's scope
        (`query_cache_scope`). The CLI and Python API, the Serve ingress and the batch actors
        all answer through one."""
        from selfrag.infra.cache.answer_cache import open_query_cache

        return cls(
            settings.decoding,
            facts=facts,
            cache=open_query_cache(settings),
            cache_scope=query_cache_scope(settings),
            max_timeout_s=max_timeout_s,
            events=events,
        )

    def reporting(self, events: AnswerEvents) -> AnswerPath:
        """This path (its defaults, facts, cache and limits) reporting to `events`."""
        path = copy.copy(self)
        path._events = events
        return path

    def deadline(self, timeout_s: float) -> Deadline:
        """A deadline for one answer along this path: its expiry is counted once
        (`count_deadline`), whether the caller's timer or the decode sees it first."""
        events = self._events
        return Deadline(timeout_s, on_expire=events.count_deadline if events is not None else None)

    def config(self, request: AnswerRequest, facts: CritiqueFacts | None = None) -> DecodingConfig:
        """The settled config of `request` (`requested`, then `settle`)."""
        return self.settle(self.requested(request), facts)

    def settle(self, config: DecodingConfig, facts: CritiqueFacts | None = None) -> DecodingConfig:
        """`config` as it is decoded and keyed: its critique source resolved to the concrete
        one (`resolve`) and its unset filters filled with what was calibrated for that source
        on the served collection, else off (`pipeline.critics.filters.settle_filters`), by
        `facts` (else the path's own; `LocalRuntime`'s calibrate a missing threshold on first
        use there). A settled config settles to itself. Every answer's config is settled here,
        whichever client answers it."""
        facts = self._facts_or(facts)
        name = self.resolve(config, facts).critique
        return settle_filters(config, name, facts.calibrated_filters(name))

    def resolve(self, config: DecodingConfig, facts: CritiqueFacts | None = None) -> DecodingConfig:
        """`config` with its critique source the concrete one it stands for on this model
        (`auto` to native, learned or likelihood), by `facts` (else the path's own); its
        filters as they are. A source this model cannot run is `Unprocessable`."""
        facts = self._facts_or(facts)
        try:
            name = facts.critique_name(config.critique)
        except CritiqueUnavailable as exc:
            raise Unprocessable(str(exc)) from exc
        return config if name == config.critique else config.model_copy(update={"critique": name})

    def retrieval(
        self, request: RetrieveRequest, facts: CritiqueFacts | None = None
    ) -> DecodingConfig:
        """The config a retrieval is read with: its `top_k` and `critique` over the defaults,
        the source resolved (`resolve`); no filter applies to a retrieval, so none is filled
        (and no threshold is calibrated for it)."""
        dials = DecodingOverrides.model_validate(
            {"top_k": request.top_k, "critique": request.critique}
        )
        return self.resolve(self.dials(dials), facts)

    def _facts_or(self, facts: CritiqueFacts | None) -> CritiqueFacts:
        facts = facts if facts is not None else self._facts
        if facts is None:
            raise ValueError("settling a config needs the deployment's CritiqueFacts")
        return facts

    def dials(self, overrides: DecodingOverrides) -> DecodingConfig:
        """The defaults under `overrides` (a request's or a command's dials), not settled."""
        return overrides.apply_to(self.defaults)

    def requested(self, request: AnswerRequest) -> DecodingConfig:
        """The request's dials over the defaults, not settled yet; refused when past the
        server's limits."""
        config = self.dials(request.config)
        if request.max_tokens is not None:
            config = config.within_tokens(request.max_tokens)
        if self._max_timeout_s is not None and config.timeout_s > self._max_timeout_s:
            raise Unprocessable(
                f"timeout_s={config.timeout_s:g} is above this server's maximum "
                f"({self._max_timeout_s:g} s, serve.max_timeout_s)"
            )
        return config

    def key(self, question: str, config: DecodingConfig, identity: CacheIdentity) -> str:
        return query_key(
            question, config, identity.index_version, identity.model_fingerprint, self._scope
        )

    def lookup(self, key: str) -> AnswerResponse | None:
        """The cached answer, or None; a failing cache is bypassed, never an error."""
        assert self.cache is not None
        try:
            hit = self.cache.get(key)
        except Exception as exc:
            log.warning("query cache get failed, bypassing: %s", exc)
            self._count("errors")
            return None
        self._count("hits" if hit is not None else "misses")
        return hit

    def store(self, key: str, response: AnswerResponse) -> CacheStatus:
        assert self.cache is not None
        try:
            self.cache.put(key, response)
        except Exception as exc:
            log.warning("query cache put failed: %s", exc)
            self._count("errors")
            return "error"
        return "miss"

    def run(
        self,
        question: str,
        config: DecodingConfig,
        decode: Decode,
        *,
        identity: Callable[[], CacheIdentity] | None = None,
        deadline: Deadline | None = None,
        on_step: StepListener | None = None,
    ) -> Answer:
        """Answer from the cache, else by `decode`, then cache it. `identity` is asked only
        when a cache is configured; failures come out as `AnswerError`s (a bug stays itself).
        `deadline`: one of `self.deadline` (else its expiry is not counted)."""
        deadline = deadline or self.deadline(config.timeout_s)
        key: str | None = None
        try:
            # An unseeded sampled answer is a fresh draw each time: never cached.
            if self.cache is not None and identity is not None and config.repeatable:
                key = self.key(question, config, identity())
                hit = self.lookup(key)
                if hit is not None:
                    if on_step is not None:
                        on_step(Hypothesis(segments=tuple(hit.segments), done=True))
                    return Answer(hit, "hit")
            deadline.check()
            response = decode(question, config, deadline, on_step)
        except DeadlineExceeded:
            deadline.expire()  # counted unless a check or the caller's timer expired it first
            raise
        except AnswerError:
            raise
        except ValueError as exc:  # a request the configured system cannot answer
            raise Unprocessable(str(exc)) from exc
        if key is None:
            return Answer(response, "off")
        return Answer(response, self.store(key, response))

    def _count(self, event: str) -> None:
        if self._events is not None:
            self._events.count_cache(event)
