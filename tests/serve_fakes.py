"""In-process stand-ins for the Ray Serve deployment handles that `actors.http.service` calls,
around
the scripted critic of tests/fakes.py; for unit tests of the answer service and the HTTP layer.

A call starts when `.remote()` is called, in a thread of its own, as a remote call runs
elsewhere: `.result(timeout_s=...)` waits for it (raising `TimeoutError`, as Ray's does),
`await` waits without blocking the loop, and `.cancel()` records that the caller gave up.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.service import ServeAnswerService
from selfrag.pipeline.branching import expand
from selfrag.pipeline.protocols import Passage
from selfrag.pipeline.ranking import rank_step
from selfrag.runtime.answering import AnswerPath, query_cache_scope
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import Unprocessable
from selfrag.schemas.settings import Settings
from tests.fakes import ListRetriever, ScriptedCritic

# Enough threads that calls left hanging by a test never starve the next ones.
_CALLS = ThreadPoolExecutor(64, thread_name_prefix="fake-remote")


class Response:
    """Stands in for a DeploymentResponse."""

    def __init__(self, fn: Callable[[], Any], calls: list[Response]) -> None:
        self._future: Future[Any] = _CALLS.submit(fn)
        self.cancelled = False
        calls.append(self)

    def result(self, timeout_s: float | None = None) -> Any:
        # concurrent.futures.TimeoutError is the builtin TimeoutError, as Ray raises.
        return self._future.result(timeout=timeout_s)

    def cancel(self) -> None:
        self.cancelled = True
        self._future.cancel()

    def __await__(self) -> Generator[Any, None, Any]:
        return asyncio.wrap_future(self._future).__await__()


class _Method:
    def __init__(self, fn: Callable[..., Any], calls: list[Response]) -> None:
        self._fn = fn
        self._calls = calls

    def remote(self, *args: Any) -> Response:
        return Response(lambda: self._fn(*args), self._calls)


class Handle:
    """Routes `handle.name.remote(...)` to `target.name(...)`; `calls` lists every call."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self.calls: list[Response] = []

    def options(self, **options: Any) -> Handle:
        """Routing options (`session_id`) change nothing in-process; they are recorded."""
        self.options_seen = options
        return self

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name), self.calls)


class Pool:
    """The BranchPool's methods over a scripted critic. `delay_s` slows every draft;
    `hang` (while clear) makes drafts block until it is set, as a hung replica would."""

    def __init__(self, critic: ScriptedCritic, delay_s: float = 0.0) -> None:
        self.critic = critic
        self.delay_s = delay_s
        self.hang: threading.Event | None = None
        self.drafts_started = 0
        self.fingerprint = "scripted-model sha256:00"
        self.calibrated: dict[str, object] = {}

    def model_id(self) -> str:
        return "scripted-model"

    def model_fingerprint(self) -> str:
        return self.fingerprint

    def critic_name(self, source: str) -> str:
        """As `BranchPool.critic_name`: a source this model cannot run is a 422."""
        if source == "native":
            raise Unprocessable("critique 'native' needs a Self-RAG checkpoint")
        return self.critic.name

    def calibrated_filters(self, critic_name: str) -> dict[str, object]:
        """As `BranchPool.calibrated_filters`: the scripted calibration (none by default)."""
        return self.calibrated

    def ready(self) -> bool:
        return True

    def expand(self, source, candidates, cfg, timeout_s):  # type: ignore[no-untyped-def]
        """The pool's one call per step: the branch work over this pool's methods."""
        return expand(_PoolMethods(self, source), candidates, cfg)

    def relevance(self, source, branches):  # type: ignore[no-untyped-def]
        return self.critic.relevance(branches)

    def draft(self, source, branches, max_tokens):  # type: ignore[no-untyped-def]
        self.drafts_started += 1
        if self.hang is not None:
            self.hang.wait(60.0)
        time.sleep(self.delay_s)
        return self.critic.draft(branches, max_tokens)

    def support(self, source, branches, drafts):  # type: ignore[no-untyped-def]
        return self.critic.support(branches, drafts)

    def utility(self, source, branches, drafts):  # type: ignore[no-untyped-def]
        return self.critic.utility(branches, drafts)


class _PoolMethods:
    """A `Critic` over a fake pool's methods (which count, delay and hang drafts)."""

    def __init__(self, pool: Pool, source: str) -> None:
        self._pool = pool
        self._source = source
        self.name = pool.critic.name

    def retrieval(self, branches):  # type: ignore[no-untyped-def]
        return self._pool.critic.retrieval(branches)

    def relevance(self, branches):  # type: ignore[no-untyped-def]
        return self._pool.relevance(self._source, branches)

    def draft(self, branches, max_tokens):  # type: ignore[no-untyped-def]
        return self._pool.draft(self._source, branches, max_tokens)

    def support(self, branches, drafts):  # type: ignore[no-untyped-def]
        return self._pool.support(self._source, branches, drafts)

    def utility(self, branches, drafts):  # type: ignore[no-untyped-def]
        return self._pool.utility(self._source, branches, drafts)


class Decider:
    def __init__(self, critic: ScriptedCritic) -> None:
        self.critic = critic
        self.up = True

    def ready(self) -> bool:
        if not self.up:  # as a call to a replica that is gone
            raise RuntimeError("the decider's replica is down")
        return True

    def decide(self, source, branches, timeout_s):  # type: ignore[no-untyped-def]
        return self.critic.retrieval(branches)


class Store(ListRetriever):
    def __init__(self, passages: list[Passage], delay_s: float = 0.0) -> None:
        super().__init__(passages)
        self.delay_s = delay_s
        self.version_calls = 0

    def index_version(self) -> str:
        self.version_calls += 1
        time.sleep(self.delay_s)
        return "v1"

    def ready(self) -> bool:
        return True


class Ranker:
    def rank(self, beam, live, drafted, cfg):  # type: ignore[no-untyped-def]
        return rank_step(beam, live, drafted, cfg)


class DictCache:
    def __init__(self, broken: bool = False) -> None:
        self.data: dict[str, AnswerResponse] = {}
        self.broken = broken

    def get(self, key: str) -> AnswerResponse | None:
        if self.broken:
            raise ConnectionError("redis down")
        return self.data.get(key)

    def put(self, key: str, response: AnswerResponse) -> None:
        if self.broken:
            raise ConnectionError("redis down")
        self.data[key] = response


NORMANS = [Passage("p1", "Rollo founded Normandy.", "Normans")]


@dataclass
class Rig:
    """A `ServeAnswerService` over the fakes, and the fakes themselves."""

    service: ServeAnswerService
    metrics: Metrics
    pool: Pool
    pool_handle: Handle
    store: Store
    store_handle: Handle


def make_service(
    *,
    pool: Pool | None = None,
    store: Store | None = None,
    cache: DictCache | None = None,
    max_inflight: int = 4,
    index_version_ttl_s: float = 0.0,
    max_timeout_s: float | None = None,
    settings: Settings | None = None,
    affinity: bool = True,
    decider: Decider | None = None,
    collection: str | None = None,
) -> Rig:
    """The answer service over fakes (one segment per answer by default); `collection`: the
    one it serves (None: it answers only requests that name none)."""
    pool = pool or Pool(ScriptedCritic(relevance_of={"p1": 0.9}))
    store = store or Store(list(NORMANS))
    metrics = Metrics()
    pool_handle = Handle(pool)
    store_handle = Handle(store)
    service = ServeAnswerService(
        pool=pool_handle,  # type: ignore[arg-type]
        decider=Handle(decider or Decider(pool.critic)),  # type: ignore[arg-type]
        retriever=store_handle,  # type: ignore[arg-type]
        ranker=Handle(Ranker()),  # type: ignore[arg-type]
        path=AnswerPath(
            DecodingConfig(max_segments=1),
            cache=cache,
            cache_scope=query_cache_scope(settings or Settings(home=Path("/nonexistent"))),
            max_timeout_s=max_timeout_s,
            events=metrics,
        ),
        max_inflight=max_inflight,
        metrics=metrics,
        index_version_ttl_s=index_version_ttl_s,
        affinity=affinity,
        collection=collection,
    )
    return Rig(service, metrics, pool, pool_handle, store, store_handle)
