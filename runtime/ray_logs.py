"""How much of Ray's own logging reaches the terminal of a command that starts Ray or Serve."""

from __future__ import annotations

import logging
import os
import sys

QUIET_LOGGERS = ("ray._private.worker", "ray.serve")
"""Ray's driver-side loggers whose INFO records (the instance started, Serve's deployments)
stay out of a command's stderr unless it runs with -v (the driver writes them nowhere else)."""
SERVE_TO_STDERR_ENV = "RAY_SERVE_LOG_TO_STDERR"
COLOR_PREFIX_ENV = "RAY_COLOR_PREFIX"


def quiet_ray(verbose: bool) -> None:
    """Set before Ray starts (its processes inherit the environment): without `verbose`, Ray's
    and Serve's own records go only to the session's log files (`/tmp/ray/session_latest/logs`),
    this process's Ray loggers show warnings and worse only, and Ray Data's console only errors
    (its own log file keeps the rest; its "progress bars disabled" is no news: the command
    draws its own). Ray colours the prefix of a forwarded line only when stderr is a terminal.
    Call after importing `ray.serve` or `ray.data`, which set up their loggers when imported."""
    if not sys.stderr.isatty():
        os.environ[COLOR_PREFIX_ENV] = "0"
    if verbose:
        return
    os.environ[SERVE_TO_STDERR_ENV] = "0"
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(
            handler, logging.FileHandler
        ):
            handler.setLevel(logging.ERROR)


def serve_logs_to_files_only() -> bool:
    """Whether Serve's components keep their records in their log files only (`quiet_ray`)."""
    return os.environ.get(SERVE_TO_STDERR_ENV) == "0"


def terminal_handler(level: int = logging.WARNING) -> logging.Handler:
    """A handler that writes records of `level` and worse to the process's real stderr (a
    Serve replica replaces `sys.stderr` with a logger when its logs go to files only), where
    Ray forwards them to the terminal of the command that started it."""
    handler = logging.StreamHandler(sys.__stderr__)
    handler.set_name(TERMINAL_HANDLER)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("selfrag: %(levelname)s: %(message)s"))
    return handler


TERMINAL_HANDLER = "selfrag-terminal"
"""The name of the handlers `terminal_handler` makes."""


def is_terminal_handler(handler: logging.Handler) -> bool:
    """Whether `handler` is one `terminal_handler` made."""
    return handler.get_name() == TERMINAL_HANDLER


class _RestartNoticeProbe:
    """An actor of the kind Ray's restart notice is about; never needs to start."""

    def __init__(self, arg: object) -> None:
        del arg


_restart_notice_spent = False


def spend_restart_notice() -> None:
    """Without -v (`quiet_ray`), keep Ray's notice that an actor which may restart has
    constructor arguments in the object store out of this driver's stderr (call once Ray runs).

    Ray's core worker logs that notice at ERROR once per process, to the driver's log file and,
    like every error of a driver, to stderr. Every Ray Data actor pool meets it: the pool's
    actors take their DataContext and transform as ObjectRefs and restart without limit, which
    a batch needs (a lost node's engine actors restart on the others). The failed restart it
    warns of does not happen here: the driver owns those objects, and Ray Data holds them while
    the pool lives. So a probe actor of that kind is created, with fd 2 on /dev/null for the
    call, and killed: its notice stays in the driver's log file, and Ray logs no other."""
    global _restart_notice_spent
    import ray

    verbose = not serve_logs_to_files_only()
    if _restart_notice_spent or verbose or ray.util.client.ray.is_connected():
        return  # a Ray client's driver runs on the cluster: its log is not this stderr
    _restart_notice_spent = True
    probe = ray.remote(num_cpus=0, max_restarts=1)(_RestartNoticeProbe)
    sys.stderr.flush()
    stderr = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        actor = probe.remote(ray.put(None))
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(null)
    ray.kill(actor, no_restart=True)
