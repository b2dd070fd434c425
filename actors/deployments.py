"""Ray Serve deployments: thin wrappers around `pipeline/` and `infra/` pieces.

* `BranchPool` owns a llama.cpp engine (loaded in the replica's own process) and does all
  branch work of a request's step in one call, merging concurrent requests' engine calls.
* `RetrievalDecider` decides retrieval for a step's hypotheses on an engine of its own.
* `Retriever` searches Qdrant. Embedded Qdrant locks its folder: keep it at one replica then.
* `Ranker` applies critique weights, hard filters and the beam (`pipeline.ranking.rank_step`).
* `SelfRAGIngress` serves the HTTP API (`actors.http.routes`) and runs the decoder
(`actors.http.service`).

CPU requests are fractional so the whole application fits on a 2-core machine: Serve never
schedules a replica asking for more CPUs than the cluster has, and `serve.run` would wait.

Every replica records its metrics through `ray.serve.metrics` (`actors.http.metrics.RaySink`), which
Ray's metrics agent exports per node, tagged with the replica; the ingress also keeps them in a
registry of its own for `GET /metrics`. Each replica's selfrag log records go where Serve's own
go (`adopt_serve_logging`), at `serve.log_level` and in `serve.log_encoding`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from fastapi import FastAPI
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from selfrag.actors.http.metrics import EngineMetrics, Metrics, PrometheusSink, RaySink
from selfrag.actors.http.routes import build_http_app, parse_api_keys
from selfrag.actors.http.service import ServeAnswerService
from selfrag.infra.settings_loader import API_KEYS_ENV
from selfrag.pipeline.branching import StepWork, expand
from selfrag.pipeline.critics import Branch, Critic, CritiqueUnavailable, LabelProbs
from selfrag.pipeline.ranking import Candidate, Drafted, Hypothesis, StepRanking, rank_step
from selfrag.runtime.answering import AnswerPath, Deadline
from selfrag.runtime.engine_worker import EngineWorker
from selfrag.runtime.merging import MergedCritic
from selfrag.runtime.passage_service import PassageService
from selfrag.runtime.ray_logs import (
    is_terminal_handler,
    serve_logs_to_files_only,
    terminal_handler,
)
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import Unprocessable
from selfrag.schemas.settings import Settings

if TYPE_CHECKING:
    from selfrag.runtime.system import LocalRuntime

log = logging.getLogger("selfrag.actors")
_T = TypeVar("_T")


def adopt_serve_logging(
    level: str, *, serve_logger: str = "ray.serve", ours: str = "selfrag"
) -> bool:
    """In a replica, send selfrag's log records where Serve's own go (its replica log file,
    TEXT or JSON as `serve.log_encoding` says, and stderr) at `level` (`serve.log_level`):
    Serve applies its `LoggingConfig` to its `ray.serve` logger only. False, changing nothing,
    where that logger has no handlers (not in a replica)."""
    source = logging.getLogger(serve_logger)
    if not source.handlers:
        return False
    target = logging.getLogger(ours)
    target.setLevel(level)
    for handler in source.handlers:
        if handler not in target.handlers:
            target.addHandler(handler)
    target.propagate = False  # the worker's root handler would print each record a second time
    if serve_logs_to_files_only() and not any(is_terminal_handler(h) for h in target.handlers):
        # Serve's own records stay in its files; selfrag's warnings still reach the terminal.
        target.addHandler(terminal_handler())
    return True


def requested_critic(rag: LocalRuntime, source: str) -> Critic:
    """The critic a request's `critique` names. A source this model cannot run is the
    request's choice: a 422 saying so (`Unprocessable`); any other failure to build it is the
    deployment's, and stays a 500."""
    try:
        return rag.critic(source)
    except CritiqueUnavailable as exc:
        raise Unprocessable(str(exc)) from None


class _EngineWorker:
    """The replica's `runtime.engine_worker.EngineWorker`, run from the event loop: each
    request in a thread of its own, a critique source it cannot run a 422, every engine call's
    batch size and, after each request, the passage KV-state store's tier counters sent to
    Ray's metrics export."""

    def __init__(self, settings: Settings, max_threads: int) -> None:
        adopt_serve_logging(settings.serve.log_level)
        self.metrics = EngineMetrics([RaySink()])
        self._worker = EngineWorker(
            settings,
            merge_wait_s=settings.serve.batch_wait_ms / 1000,
            max_calls=settings.serve.max_batch_size,
            on_batch=self.metrics.record_batch,
        )
        self.rag = self._worker.rag
        self.engine = self._worker.engine
        # A thread per ongoing request: the default executor has only cpu+4 threads.
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix="selfrag-engine")

    async def run(self, source: str, timeout_s: float, work: Callable[[MergedCritic], _T]) -> _T:
        """`work` on a critic whose calls merge with the other requests' ones."""
        requested_critic(self.rag, source)  # a 422 before any engine work
        deadline = Deadline(timeout_s)

        def call() -> _T:
            try:
                return self._worker.run(source, deadline, work)
            finally:
                self.metrics.sync_kv_store(self.rag.kv_store_counters())

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)


# A request's steps go to the replica that holds its KV slots (its prompts grow step by step):
# the ingress sends every call of one answer with the same `session_id`, and the consistent-
# hash router maps it to one replica (falling back to the next ones under backpressure).
AFFINITY = RequestRouterConfig(
    request_router_class="ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
    request_router_kwargs={"num_virtual_nodes": 100, "num_fallback_replicas": 2},
)


# The pool's CPU reservation; `pool_replicas` > 1 replicas share it (actors/serve_app.py).
POOL_CPUS = 0.5


@serve.deployment(
    ray_actor_options={"num_cpus": POOL_CPUS},
    max_ongoing_requests=128,
    request_router_config=AFFINITY,
)
class BranchPool:
    """The branch-generation pool: all branches of a request's step in one call — relevance,
    pruning, drafting, support and utility (`pipeline.branching.expand`) — with the engine
    calls of concurrent requests merged into multi-sequence llama.cpp batches."""

    def __init__(self, settings: Settings) -> None:
        self._worker = _EngineWorker(settings, max_threads=128)
        self._rag = self._worker.rag

    async def expand(
        self, source: str, candidates: list[Candidate], cfg: DecodingConfig, timeout_s: float
    ) -> StepWork:
        return await self._worker.run(
            source, timeout_s, lambda critic: expand(critic, candidates, cfg)
        )

    async def relevance(
        self, source: str, branches: list[Branch], timeout_s: float
    ) -> list[LabelProbs]:
        """The relevance read of each branch (a retrieval without drafting)."""
        return await self._worker.run(source, timeout_s, lambda critic: critic.relevance(branches))

    def model_id(self) -> str:
        return self._worker.engine.model_id

    def model_fingerprint(self) -> str:
        """`LocalRuntime.model_fingerprint`: the model's identity in query-cache keys."""
        return self._rag.model_fingerprint

    def calibrated_filters(self, critic_name: str) -> dict[str, object]:
        """The filter defaults calibrated on the served corpus for the source `critic_name`
        (`LocalRuntime.calibrated_filters`)."""
        return self._rag.calibrated_filters(critic_name)

    def critic_name(self, source: str) -> str:
        """The critique source `source` resolves to; `Unprocessable` when this model cannot
        run it."""
        return requested_critic(self._rag, source).name

    def ready(self) -> bool:
        return bool(self._worker.engine.tokenize("ready"))


@serve.deployment(
    ray_actor_options={"num_cpus": 0.5},
    max_ongoing_requests=128,
    request_router_config=AFFINITY,
)
class RetrievalDecider:
    """The retrieval-decision generator, on an engine of its own: p(retrieve) for the live
    hypotheses of a step (for the likelihood critique, with the closed-book draft it is read
    from, which becomes the no-retrieval branch's draft)."""

    def __init__(self, settings: Settings) -> None:
        self._worker = _EngineWorker(settings, max_threads=128)

    async def decide(
        self, source: str, branches: list[Branch], timeout_s: float
    ) -> list[LabelProbs]:
        return await self._worker.run(source, timeout_s, lambda critic: critic.retrieval(branches))

    def ready(self) -> bool:
        return bool(self._worker.engine.tokenize("ready"))


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32)
class Retriever(PassageService):
    """The passage store behind the ingress (`runtime.passage_service`). Embedded Qdrant locks
    its folder: keep it at one replica then."""

    def __init__(self, settings: Settings) -> None:
        adopt_serve_logging(settings.serve.log_level)
        super().__init__(settings)


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=64)
class Ranker:
    """Critique-weighted scores, hard filters and the segment beam of one step."""

    def rank(
        self,
        beam: list[Hypothesis],
        live: list[Hypothesis],
        drafted: list[Drafted],
        cfg: DecodingConfig,
    ) -> StepRanking:
        return rank_step(beam, live, drafted, cfg)


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=256)
@serve.ingress()
class SelfRAGIngress:
    """The HTTP API. Runs the same `BeamDecoder` as the CLI, its calls going to the
    other deployments."""

    def __init__(
        self,
        pool: DeploymentHandle,
        decider: DeploymentHandle,
        retriever: DeploymentHandle,
        ranker: DeploymentHandle,
        settings: Settings,
    ) -> None:
        adopt_serve_logging(settings.serve.log_level)
        # Its own registry for GET /metrics, and Ray's export with every other replica's.
        self._metrics = Metrics(PrometheusSink("ingress"), RaySink())
        self._service = ServeAnswerService(
            pool=pool,
            decider=decider,
            retriever=retriever,
            ranker=ranker,
            path=AnswerPath.for_settings(
                settings, max_timeout_s=settings.serve.max_timeout_s, events=self._metrics
            ),
            max_inflight=settings.serve.max_inflight,
            metrics=self._metrics,
            index_version_ttl_s=settings.serve.index_version_ttl_s,
            affinity=settings.serve.affinity,
            collection=settings.retrieval.collection,
        )
        self._serve_settings = settings.serve

    def drain(self) -> int:
        """`ServeAnswerService.drain`: new answers are refused (503), the count of those still
        running returned; `selfrag serve` calls it when it stops."""
        return self._service.drain()

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Keys come from this replica's environment, never through deployment arguments.
        return build_http_app(
            self._service,
            self._metrics,
            api_keys=parse_api_keys(os.environ.get(API_KEYS_ENV)),
            retry_after_s=self._serve_settings.retry_after_s,
            log_questions=self._serve_settings.log_questions,
            model_name=self._serve_settings.model_name,
            documents=self._service,
            # The address the proxies really bind (actors/serve_app.py puts it in serve.host).
            bind_host=self._serve_settings.host,
            allowed_hosts=self._serve_settings.allowed_hosts,
            # Serve's proxy sets X-Request-Id on the request and echoes it on the response.
            request_id_header=False,
        )
