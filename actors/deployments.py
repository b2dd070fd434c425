"""Ray Serve deployments: thin wrappers around `pipeline/` and `infra/` pieces.

* `BranchPool` owns the llama.cpp engine (loaded in the replica's own process) and merges the
  critique calls of concurrent requests into one engine call with `@serve.batch`.
* `RetrievalDecider` asks the pool for the retrieval probabilities of a batch of hypotheses.
* `Retriever` searches Qdrant. Embedded Qdrant locks its folder: keep it at one replica then.
* `Ranker` applies critique weights, hard filters and the beam (`pipeline.ranking.rank_step`).
* `SelfRAGIngress` serves the HTTP API (`actors.http`) and runs the decoder (`actors.service`).

CPU requests are fractional so the whole application fits on a 2-core machine: Serve never
schedules a replica asking for more CPUs than the cluster has, and `serve.run` would wait.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from selfrag.actors.http import build_http_app, parse_api_keys
from selfrag.actors.metrics import BatchStats, Metrics, family
from selfrag.actors.service import ServeAnswerService
from selfrag.infra.settings import API_KEYS_ENV
from selfrag.pipeline.critics import Branch, LabelProbs
from selfrag.pipeline.protocols import Generation, Passage
from selfrag.pipeline.ranking import Candidate, Hypothesis, StepRanking, rank_step
from selfrag.runtime.answering import QueryCache, query_cache_scope
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import DependencyDown, Misconfigured
from selfrag.schemas.settings import Settings

if TYPE_CHECKING:
    from selfrag.infra.qdrant_store import QdrantStore

log = logging.getLogger("selfrag.actors")


@dataclass(frozen=True)
class PoolStats:
    """What the branch pool adds to `/metrics`: its batch sizes and the tier counters of its
    passage KV-state store (hits, misses, Redis errors, states refused by reason)."""

    batches: BatchStats
    kv_store: dict[str, int]

    def render(self) -> list[str]:
        lines = self.batches.render()
        if self.kv_store:
            lines += family(
                "selfrag_kv_cache_tier_total",
                "counter",
                "Passage KV-state store by tier: memory/redis hits, misses, puts, Redis errors "
                "and bypassed calls, and states read from Redis but refused (redis_rejected_*).",
                [({"event": k}, v) for k, v in sorted(self.kv_store.items())],
            )
        return lines


@dataclass(frozen=True)
class _Call:
    """One request's share of a critique batch."""

    source: str
    branches: list[Branch]
    drafts: list[Generation] | None = None
    max_tokens: int | None = None


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=128)
class BranchPool:
    """The engine and its cross-request batching. One engine call per (method, critique
    source, max_tokens) group of a batch; the engine runs all its branches as one
    multi-sequence llama.cpp batch."""

    def __init__(self, settings: Settings) -> None:
        from selfrag.runtime.system import SelfRAG

        self._rag = SelfRAG(settings)
        self._engine = self._rag.engine  # load now, in this process; never fork after this
        self._stats = BatchStats()
        size = settings.serve.max_batch_size
        self._queue = EngineQueue(self._engine_call, size, self._stats)
        wait = settings.serve.batch_wait_ms / 1000
        for handler in (
            self._retrieval,
            self._relevance,
            self._draft,
            self._support,
            self._utility,
        ):
            handler.set_max_batch_size(size)
            handler.set_batch_wait_timeout_s(wait)

    def model_id(self) -> str:
        return self._engine.model_id

    def model_fingerprint(self) -> str:
        """`SelfRAG.model_fingerprint`: the model's identity in query-cache keys."""
        return self._rag.model_fingerprint

    def critic_name(self, source: str) -> str:
        """The critique source `source` resolves to; raises ValueError when unusable."""
        return self._rag.critic(source).name

    def ready(self) -> bool:
        return bool(self._engine.tokenize("ready"))

    def stats(self) -> PoolStats:
        return PoolStats(copy.deepcopy(self._stats), dict(self._rag.kv_store_counters()))

    async def retrieval(self, source: str, branches: list[Branch]) -> list[LabelProbs]:
        return await self._retrieval(_Call(source, branches))

    async def relevance(self, source: str, branches: list[Branch]) -> list[LabelProbs]:
        return await self._relevance(_Call(source, branches))

    async def draft(self, source: str, branches: list[Branch], max_tokens: int) -> list[Generation]:
        return await self._draft(_Call(source, branches, max_tokens=max_tokens))

    async def support(
        self, source: str, branches: list[Branch], drafts: list[Generation]
    ) -> list[LabelProbs]:
        return await self._support(_Call(source, branches, drafts))

    async def utility(
        self, source: str, branches: list[Branch], drafts: list[Generation]
    ) -> list[LabelProbs]:
        return await self._utility(_Call(source, branches, drafts))

    # @serve.batch collects the calls that arrive together (one queue per method, so requests
    # at the same stage of decoding meet). It hands a batch on as soon as it is formed, even
    # while the engine is busy, so the engine queue below merges the batches that wait.
    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005, max_concurrent_batches=8)
    async def _retrieval(self, calls: list[_Call]) -> list[list[Any]]:
        return await self._queue.run("retrieval", calls)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005, max_concurrent_batches=8)
    async def _relevance(self, calls: list[_Call]) -> list[list[Any]]:
        return await self._queue.run("relevance", calls)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005, max_concurrent_batches=8)
    async def _draft(self, calls: list[_Call]) -> list[list[Any]]:
        return await self._queue.run("draft", calls)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005, max_concurrent_batches=8)
    async def _support(self, calls: list[_Call]) -> list[list[Any]]:
        return await self._queue.run("support", calls)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005, max_concurrent_batches=8)
    async def _utility(self, calls: list[_Call]) -> list[list[Any]]:
        return await self._queue.run("utility", calls)

    def _engine_call(self, method: str, calls: Sequence[_Call]) -> list[Any]:
        """One engine call for all `calls` (same method, critique source and max_tokens)."""
        critic = self._rag.critic(calls[0].source)
        branches = [b for c in calls for b in c.branches]
        if method == "draft":
            assert calls[0].max_tokens is not None
            return critic.draft(branches, calls[0].max_tokens)
        if method in ("support", "utility"):
            drafts = [d for c in calls for d in (c.drafts or [])]
            return getattr(critic, method)(branches, drafts)
        return getattr(critic, method)(branches)


@dataclass
class _Pending:
    method: str
    call: _Call
    future: asyncio.Future[list[Any]]

    @property
    def key(self) -> tuple[str, str, int | None]:
        return (self.method, self.call.source, self.call.max_tokens)


class EngineQueue:
    """Runs critique calls on the engine one engine call at a time; whatever waits while the
    engine is busy is merged into the next call (at most `max_requests` calls, all with the
    same method, critique source and max_tokens; oldest first)."""

    def __init__(
        self,
        engine_call: Callable[[str, Sequence[_Call]], list[Any]],
        max_requests: int,
        stats: BatchStats,
    ) -> None:
        self._engine_call = engine_call
        self.max_requests = max_requests
        self._stats = stats
        self._pending: list[_Pending] = []
        self._busy = False
        self._drainer: asyncio.Task[None] | None = None

    async def run(self, method: str, calls: list[_Call]) -> list[list[Any]]:
        loop = asyncio.get_running_loop()
        entries = [_Pending(method, c, loop.create_future()) for c in calls]
        self._pending.extend(entries)
        if not self._busy:
            self._busy = True
            self._drainer = asyncio.create_task(self._drain())
        return list(await asyncio.gather(*(e.future for e in entries)))

    async def _drain(self) -> None:
        try:
            while self._pending:
                key = self._pending[0].key
                group = [e for e in self._pending if e.key == key][: self.max_requests]
                taken = {id(e) for e in group}
                self._pending = [e for e in self._pending if id(e) not in taken]
                calls = [e.call for e in group]
                try:
                    # The engine blocks; in a thread, this replica's event loop keeps
                    # accepting the calls that will form the next batch.
                    outputs = await asyncio.to_thread(self._engine_call, key[0], calls)
                except Exception as exc:
                    for e in group:
                        if not e.future.done():
                            e.future.set_exception(exc)
                    continue
                self._stats.record(key[0], len(group), sum(len(c.branches) for c in calls))
                start = 0
                for e in group:
                    n = len(e.call.branches)
                    if not e.future.done():
                        e.future.set_result(outputs[start : start + n])
                    start += n
        finally:
            self._busy = False


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=128)
class RetrievalDecider:
    """The retrieval-decision generator: p(retrieve) for a batch of hypotheses, computed in
    the branch pool's shared batches."""

    def __init__(self, pool: DeploymentHandle) -> None:
        self._pool = pool

    async def decide(self, source: str, branches: list[Branch]) -> list[LabelProbs]:
        return await self._pool.retrieval.remote(source, branches)


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32)
class Retriever:
    """Qdrant search (dense, or hybrid dense + BM25).

    A Qdrant server that does not answer at start-up does not stop the replica: it reports
    not ready, answers 503, and connects on a later call once the server is back. An index
    that cannot serve (no collection, built by another embedder or with vectors of another
    size) is permanent until someone acts: the replica reports not ready and answers 500
    `misconfigured` with the reason, never a 503 a client would retry forever. An embedded
    store that cannot be opened otherwise (its folder locked) is a start-up error.
    """

    # A store that failed its check at open is opened again at most this often: an embedded
    # open reads the whole collection, too slow to repeat on every request.
    RECHECK_S = 10.0

    def __init__(self, settings: Settings) -> None:
        from selfrag.runtime.system import SelfRAG

        self._rag = SelfRAG(settings)
        self._refused: tuple[float, str] | None = None  # (until when, the 500's detail)
        self._down = False
        try:
            self._store()  # opens (and checks) the store now, when it can
        except DependencyDown:
            if settings.retrieval.qdrant_url is None:
                raise  # an embedded store that does not open is a start-up error
            log.warning("the Qdrant server does not answer yet; will connect when it does")
        except Misconfigured:
            pass  # logged by _store; every call answers 500 with the reason

    def _store(self) -> QdrantStore:
        """The open store with an index that fits the embedder; DependencyDown (503) when
        the server does not answer, Misconfigured (500) when the index cannot serve."""
        # Imported here: qdrant-client costs every other replica process 0.6 s at import.
        from selfrag.infra.qdrant_store import IndexMissing, StoreMisconfigured, StoreUnavailable

        if self._refused is not None and time.monotonic() < self._refused[0]:
            raise Misconfigured(self._refused[1])
        try:
            store = self._rag.store  # a failed open is not cached: each call tries again
            store.require_index()
        except StoreUnavailable as exc:
            # The detail (it names the server) goes to the log, once per outage.
            (log.debug if self._down else log.warning)("passage store: %s", exc)
            self._down = True
            raise DependencyDown("the passage store does not answer") from exc
        except StoreMisconfigured as exc:
            if self._refused is None:
                log.error("passage store: %s", exc)
            # A missing collection is checked again on every call (one small request to an
            # open store); a store refused at open is reopened only after RECHECK_S.
            wait = 0.0 if isinstance(exc, IndexMissing) else self.RECHECK_S
            detail = f"the passage index cannot be used: {_public(exc)}"
            self._refused = (time.monotonic() + wait, detail)
            raise Misconfigured(detail) from None
        self._refused = None
        self._down = False
        return store

    def search(self, query: str, k: int) -> list[Passage]:
        from selfrag.infra.qdrant_store import StoreMisconfigured

        store = self._store()
        try:
            return store.search(query, k)
        except ValueError:
            raise
        except StoreMisconfigured as exc:  # a collection that appeared since, and does not fit
            raise Misconfigured(f"the passage index cannot be used: {_public(exc)}") from None
        except Exception as exc:
            # Store down (server gone, connection refused, closed client): a 503 for this
            # request; the Qdrant client reconnects by itself once the server answers again.
            raise DependencyDown(
                f"the passage store does not answer: {type(exc).__name__}"
            ) from None

    def index_version(self) -> str:
        store = self._store()
        try:
            return store.index_version()
        except Exception as exc:
            raise DependencyDown(
                f"the passage store does not answer: {type(exc).__name__}"
            ) from None

    def ready(self) -> bool:
        try:
            return self._store().ready()
        except (DependencyDown, Misconfigured):
            return False


def _public(exc: BaseException) -> str:
    """An index error's reason without the folder or server it names (those stay in logs)."""
    from selfrag.infra.qdrant_store import IndexMissing

    if isinstance(exc, IndexMissing):
        return "no passages are indexed: run `selfrag index PATH` with these settings first"
    return str(exc)


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=64)
class Ranker:
    """Critique-weighted scores, hard filters and the segment beam of one step."""

    def rank(
        self,
        beam: list[Hypothesis],
        live: list[Hypothesis],
        drafted: list[Candidate],
        cfg: DecodingConfig,
    ) -> StepRanking:
        return rank_step(beam, live, drafted, cfg)


def open_query_cache(settings: Settings) -> QueryCache | None:
    """The query cache configured by `settings` (infra/cache.py), or None while absent."""
    try:
        from selfrag.infra.cache import open_query_cache as _open  # type: ignore[import-not-found]
    except ImportError:  # the cache module is built separately (serving issue, item 5)
        return None
    return _open(settings)  # type: ignore[no-any-return]


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=256)
@serve.ingress()
class SelfRAGIngress:
    """The HTTP API. Runs the same `SelfRAGDecoder` as the CLI, its calls going to the
    other deployments."""

    def __init__(
        self,
        pool: DeploymentHandle,
        decider: DeploymentHandle,
        retriever: DeploymentHandle,
        ranker: DeploymentHandle,
        settings: Settings,
    ) -> None:
        self._metrics = Metrics()
        self._service = ServeAnswerService(
            pool=pool,
            decider=decider,
            retriever=retriever,
            ranker=ranker,
            defaults=settings.decoding,
            max_inflight=settings.serve.max_inflight,
            metrics=self._metrics,
            cache_scope=query_cache_scope(settings),
            cache=open_query_cache(settings),
            max_timeout_s=settings.serve.max_timeout_s,
            index_version_ttl_s=settings.serve.index_version_ttl_s,
        )
        self._serve_settings = settings.serve

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Keys come from this replica's environment, never through deployment arguments.
        return build_http_app(
            self._service,
            self._metrics,
            api_keys=parse_api_keys(os.environ.get(API_KEYS_ENV)),
            retry_after_s=self._serve_settings.retry_after_s,
            log_questions=self._serve_settings.log_questions,
        )
