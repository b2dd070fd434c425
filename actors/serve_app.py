"""The Serve application graph: ingress → decider, retriever, pool, ranker, bound from
settings. `selfrag.ray_app` (for `serve run` and serve.yaml) and `selfrag serve` build it here."""

from __future__ import annotations

import os
from typing import Any

from ray.serve import Application

from selfrag.infra.engine.engine_threads import ray_runtime_env
from selfrag.schemas.settings import Settings

APP_NAME = "selfrag"


def _with_bind_host(settings: Settings) -> Settings:
    """`settings` with serve.host the address the proxies really bind (deploy/serve.yaml and
    KubeRay set their own): the ingress checks Host headers when it is loopback, and
    `warn_if_open` warns when it is not."""
    bind = serve_http_host() or settings.serve.host
    warn_if_open(bind)
    if bind == settings.serve.host:
        return settings
    return settings.model_copy(update={"serve": settings.serve.model_copy(update={"host": bind})})


def build_app(settings: Settings | None = None) -> Application:
    """Bind the deployments: ingress → decider, retriever, pool, ranker."""
    from selfrag.actors.deployments import (
        POOL_CPUS,
        BranchPool,
        Ranker,
        RetrievalDecider,
        Retriever,
        SelfRAGIngress,
    )

    if settings is None:
        from selfrag.infra.settings_loader import load_settings

        settings = load_settings()
    settings = _with_bind_host(settings)
    # Bounded queues everywhere: past `max_queued_requests` waiting calls a handle raises
    # BackPressureError at once (the ingress answers 503 + Retry-After) instead of piling up.
    queued: dict[str, Any] = {
        "max_queued_requests": settings.serve.max_queued_requests,
        "logging_config": serve_logging(settings),
    }
    model = settings.model

    def actor(deployment: Any, **extra: Any) -> dict[str, Any]:
        # Every replica starts with the engine's OpenMP environment (infra.engine.engine_threads):
        # the engines' llama.cpp threads and the embedder's torch threads share the cores.
        # (deploy/serve.yaml's ray_actor_options replace these; it sets the variable itself.)
        return ray_runtime_env(model, {**deployment.ray_actor_options, **extra})

    # serve.yaml's autoscaling replaces a replica count, so only an explicit one is set. The
    # replicas share the pool's CPU reservation: the cores are used by their llama.cpp threads
    # (engine.n_threads each), and on a small machine a reservation per replica would leave
    # the extra ones unschedulable.
    replicas = settings.serve.pool_replicas
    pool_cpus = {"num_cpus": POOL_CPUS / replicas} if replicas > 1 else {}
    pools: dict[str, Any] = {"num_replicas": replicas} if replicas > 1 else {}
    pool = BranchPool.options(
        **queued, **pools, ray_actor_options=actor(BranchPool, **pool_cpus)
    ).bind(settings)
    decider = RetrievalDecider.options(**queued, ray_actor_options=actor(RetrievalDecider)).bind(
        settings
    )
    # Embedded Qdrant allows one client per folder; with a server URL the config may scale it.
    embedded = settings.retrieval.qdrant_url is None
    single: dict[str, Any] = {"num_replicas": 1} if embedded else {}
    node = driver_node() if embedded else None
    # The folder is on the machine whose driver builds the app (`selfrag serve`): its one
    # replica runs on that node, wherever Serve puts the others.
    pin = pinned_to(node) if node is not None else {}
    retriever = Retriever.options(
        **queued, **single, ray_actor_options=actor(Retriever, **pin)
    ).bind(settings)
    ranker = Ranker.options(**queued, ray_actor_options=actor(Ranker)).bind()
    return SelfRAGIngress.options(**queued, ray_actor_options=actor(SelfRAGIngress)).bind(
        pool, decider, retriever, ranker, settings
    )


# The label every Ray node carries with its own node id (ray.util.placement_group's
# NODE_ID_LABEL_KEY); a replica that selects it runs on that node only.
NODE_ID_LABEL = "ray.io/node-id"


def driver_node() -> str | None:
    """The node id of this process when it is a Ray driver connected while it builds the app
    (`selfrag serve`); None when Ray is not running here yet (`serve run module:app` builds
    before it connects) or this is a worker, as when Serve's controller builds the app of a
    config file (deploy/serve.yaml pins the Retriever itself)."""
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.worker.mode != ray.SCRIPT_MODE:
        return None
    return str(context.get_node_id())


def pinned_to(node_id: str) -> dict[str, Any]:
    """Replica options that schedule it on `node_id` only (a hard constraint: Serve reports
    the replica pending rather than start it on another node)."""
    return {"label_selector": {NODE_ID_LABEL: node_id}}


def serve_http_host() -> str | None:
    """The address the running Serve instance's HTTP proxies bind, which deploy/serve.yaml or
    KubeRay set, not `serve.host`; None when Ray or Serve is not running here."""
    import ray

    if not ray.is_initialized():
        return None
    # Ray has no public accessor for a running instance's http_options: ask its controller.
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return str(ray.get(controller.get_http_config.remote(), timeout=10).host)
    except (ValueError, ray.exceptions.RayError):  # no controller, or one that does not answer
        return None


def warn_if_open(host: str) -> str | None:
    """Warn (once per process and address) when an API bound to `host` would answer anyone:
    not loopback, and no API keys in the environment, read as the ingress replicas read them
    (the nodes share it)."""
    from selfrag.actors.http.routes import parse_api_keys
    from selfrag.infra.settings_loader import API_KEYS_ENV, warn_if_exposed

    return warn_if_exposed(host, parse_api_keys(os.environ.get(API_KEYS_ENV)))


def serve_logging(settings: Settings) -> dict[str, Any]:
    """Ray Serve's `logging_config` (`ray.serve.schema.LoggingConfig`) for the proxy, the
    controller and the deployments: its level (`serve.log_level`), the encoding of the replica
    log files (`serve.log_encoding`: TEXT or JSON, one object per line) and Ray's own access
    log (`serve.ray_access_log`). The replicas log selfrag's records the same way
    (`actors.deployments.adopt_serve_logging`)."""
    s = settings.serve
    return {
        "enable_access_log": s.ray_access_log,
        "encoding": s.log_encoding,
        "log_level": s.log_level,
    }


def drain(limit_s: float) -> int:
    """Stop the application admitting answers (503 with Retry-After from then on) and wait up
    to `limit_s` for those in progress to end; how many were still running (0: all ended, -1:
    the ingress did not answer)."""
    import time

    from ray import serve

    deadline = time.monotonic() + limit_s
    left = -1
    while True:
        try:
            handle = serve.get_deployment_handle("SelfRAGIngress", APP_NAME)
            left = handle.drain.remote().result(timeout_s=max(0.5, deadline - time.monotonic()))
        except Exception:  # no app yet, or the ingress is gone or stuck: nothing to wait for
            return left
        if left == 0 or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)
