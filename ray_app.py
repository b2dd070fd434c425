"""The Ray Serve application: `serve run ray_app:app`, `selfrag serve`, or `infra/serve.yaml`.

`app` is built on first access from the effective settings (`SELFRAG_*` environment, config
file), so importing this module starts nothing.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from schemas.settings import Settings

APP_NAME = "selfrag"


def build_app(settings: Settings | None = None) -> Application:
    """Bind the deployments: ingress → (decider → pool), retriever, ranker, pool."""
    from actors.deployments import BranchPool, Ranker, RetrievalDecider, Retriever, SelfRAGIngress

    if settings is None:
        from infra.settings import load_settings

        settings = load_settings()
    # Bounded queues everywhere: past `max_queued_requests` waiting calls a handle raises
    # BackPressureError at once (the ingress answers 503 + Retry-After) instead of piling up.
    queued: dict[str, Any] = {
        "max_queued_requests": settings.serve.max_queued_requests,
        "logging_config": serve_logging(settings),
    }
    pool = BranchPool.options(**queued).bind(settings)
    decider = RetrievalDecider.options(**queued).bind(pool)
    # Embedded Qdrant allows one client per folder; with a server URL the config may scale it.
    embedded = settings.retrieval.qdrant_url is None
    replicas = {"num_replicas": 1} if embedded else {}
    retriever = Retriever.options(**queued, **replicas).bind(settings)
    ranker = Ranker.options(**queued).bind()
    return SelfRAGIngress.options(**queued).bind(pool, decider, retriever, ranker, settings)


def serve_logging(settings: Settings) -> dict[str, Any]:
    """Ray Serve's `logging_config` for the proxy and the deployments."""
    return {"enable_access_log": settings.serve.ray_access_log}


def app_builder(args: dict[str, Any]) -> Application:
    """`serve run ray_app:app_builder home=/data`: settings overrides as `key=value`."""
    from infra.settings import load_settings

    return build_app(load_settings(overrides=args))


def __getattr__(name: str) -> Any:
    # PEP 562: `ray_app:app` is built only when Serve imports it.
    if name == "app":
        return build_app()
    raise AttributeError(name)
