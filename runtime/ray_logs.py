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
