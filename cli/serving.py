"""`selfrag serve`: the HTTP endpoint on Ray Serve."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from selfrag.cli.common import settings_from_args
from selfrag.runtime.ray_cluster import PORT_WAIT_S, starts_private, wait_for_port
from selfrag.schemas.settings import Settings

if TYPE_CHECKING:
    from selfrag.actors.http.starting import StartingResponder


def _check_model_runs(model: Path, n_threads: int) -> None:
    """Probe `model` on this machine's llama.cpp CPU backends (in child processes);
    `BackendError` with the reason when none runs it."""
    from selfrag.infra.engine.cpu_builds.llama_cpu_builds import check_backend

    check_backend(model, n_threads=n_threads or os.cpu_count() or 1)


def start_line(host: str, port: int) -> str:
    """The one line `selfrag serve` prints once the application is ready."""
    base = f"http://{host}:{port}"
    return (
        f"selfrag: serving at {base}: API {base}/v1 (OpenAI-compatible), playground {base}/, "
        f"API docs {base}/openapi.json; Ctrl-C stops"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Start the Serve application and block until SIGINT/SIGTERM, then shut it down (and
    the local Ray instance when this command started it). Meanwhile a private instance's port
    answers 503 with Retry-After."""
    from selfrag.actors.http.starting import StartingResponder

    settings = settings_from_args(args)
    host = args.host or settings.serve.host
    port = args.port or settings.serve.port
    # Until Serve's proxy takes the port: 503 with Retry-After, not a refused connection. First
    # thing, before the imports, checks and Ray that take seconds to minutes.
    starting = StartingResponder(host, port, settings.serve.retry_after_s)
    if not starting.open() and starts_private(args.address):
        # Serve's proxy binds with SO_REUSEPORT: on a port a stale proxy still holds (a server
        # stopped a moment ago), both would take connections. Wait for it instead.
        wait_for_port(host, port, PORT_WAIT_S, _waiting_for(port))
        starting.open()
    try:
        from selfrag.actors.serve_app import warn_if_open

        # Loud and early, before the model check and Ray: an open port without keys answers
        # anyone.
        warn_if_open(host)
        return _serve(args, settings, host, port, starting)
    finally:
        starting.close()


def _waiting_for(port: int) -> Callable[[str], None]:
    def waiting(holder: str) -> None:
        print(
            f"selfrag: port {port} is held by {holder}; waiting up to {PORT_WAIT_S:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    return waiting


def _ready_model(settings: Settings) -> None:
    """Fail here, naming the file, before Ray starts: a missing or corrupt model, or one no
    CPU backend can run, would otherwise surface as a replica that keeps failing to start.
    Then fit the served collection's support threshold if it is missing (abstention needs
    it), while the port answers 503, rather than serve without one."""
    from selfrag.infra.models.model_presets import recheck_model
    from selfrag.jobs.first_use import answering_runtime, calibrate_before_serving

    recheck_model(settings.model, settings.home)  # its bytes, not its remembered hash
    # One runtime for both, closed before Ray starts: Serve's replicas open the store next.
    with answering_runtime(settings) as rag:
        _check_model_runs(rag.model.path, settings.model.n_threads)
        calibrate_before_serving(settings, rag)


def _say_stopping(left: int, drain_s: float) -> None:
    print(
        f"selfrag: {left} answer(s) still running after {drain_s:g} s: stopping them",
        file=sys.stderr,
        flush=True,
    )


def _serve(
    args: argparse.Namespace,
    settings: Settings,
    host: str,
    port: int,
    starting: StartingResponder,
) -> int:
    """Check the model, start Ray and the application (freeing the port from `starting` just
    before Serve's proxy binds it), and block until SIGINT/SIGTERM."""
    import signal
    import threading

    if settings.model.backend == "llama_cpp":
        _ready_model(settings)
    from ray import serve

    from selfrag.actors.serve_app import APP_NAME, build_app, drain, serve_logging
    from selfrag.runtime.ray_cluster import init_ray, shutdown_private_ray
    from selfrag.runtime.ray_logs import quiet_ray

    quiet_ray(args.verbose)
    local = init_ray(args.address, log_to_driver=True)  # True: a private instance, ours
    stop = threading.Event()
    # Installed after ray.init, which sets handlers of its own.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        # Built before the proxy takes the port: it answers 404 until the app's route exists.
        app = build_app(settings)
        starting.close()
        serve.start(
            http_options={"host": host, "port": port}, logging_config=serve_logging(settings)
        )
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        print(start_line(host, port), file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
        print("selfrag: shutting down", file=sys.stderr, flush=True)
        # The answers in progress end first, within a bounded grace.
        left = drain(settings.serve.drain_s)
        if left > 0:
            _say_stopping(left, settings.serve.drain_s)
    finally:
        if local:
            # Every process of the instance, the proxy and the replicas included: Ray's workers
            # are in process groups of their own, out of reach of a signal to ours.
            shutdown_private_ray()
        else:
            serve.delete(APP_NAME)
    if local:
        # Ray's exit hooks would wait on the GCS and raylet just killed (5 to 13 s measured),
        # past a supervisor's grace period; nothing of this process is left to run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
