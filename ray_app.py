"""The Ray Serve application: `serve run selfrag.ray_app:app`, `selfrag serve`, or
`deploy/serve.yaml`.

`app` is built on first access from the effective settings (`SELFRAG_*` environment, config
file), so importing this module starts nothing. Building it first settles the default request
once where the store is (`jobs.first_use.calibrate_before_serving`: a missing support threshold
is calibrated then, as `selfrag serve` and every in-process answer would), and warns (WARNING
log and stderr) when the HTTP proxies bind a non-loopback address and `SELFRAG_API_KEYS` is
empty.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from selfrag.actors.serve_app import build_app
from selfrag.jobs.first_use import calibrate_before_serving
from selfrag.schemas.settings import Settings


def served_app(settings: Settings) -> Application:
    """The application of `settings`, the default request's threshold calibrated first."""
    calibrate_before_serving(settings)
    return build_app(settings)


def app_builder(args: dict[str, Any]) -> Application:
    """`serve run selfrag.ray_app:app_builder home=/data`: settings overrides as `key=value`."""
    from selfrag.infra.settings_loader import load_settings

    return served_app(load_settings(overrides=args))


def __getattr__(name: str) -> Any:
    # PEP 562: `selfrag.ray_app:app` is built only when Serve imports it.
    if name == "app":
        from selfrag.infra.settings_loader import load_settings

        return served_app(load_settings())
    raise AttributeError(name)
