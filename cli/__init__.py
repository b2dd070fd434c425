"""The `selfrag` command line: index, ask, serve, status, config, models, eval, calibrate, batch,
train; one module per command group beside this one, which dispatches and sets up logging.

One logging setup for every command (`cli_logging`): selfrag's records go to stderr at INFO,
DEBUG with `-v`, WARNING with `-q`; each skipped input record is logged once, by the job that
skipped it, and never printed again here. Everything printed passes `cli.terminal`'s filter of
terminal control characters (corpus titles and text, answers, file names can carry them).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from selfrag.cli.ask import cmd_ask
from selfrag.cli.common import EXIT_FAILED, EXIT_USAGE, CLIError
from selfrag.cli.docs import cmd_docs
from selfrag.cli.jobs import cmd_batch, cmd_calibrate, cmd_eval, cmd_index
from selfrag.cli.parser import build_parser
from selfrag.cli.serving import cmd_serve
from selfrag.cli.status import cmd_config, cmd_models, cmd_status
from selfrag.cli.terminal import terminal_safe_output
from selfrag.cli.train import cmd_train
from selfrag.schemas.errors import AnswerError

COMMANDS = {
    "index": cmd_index,
    "docs": cmd_docs,
    "ask": cmd_ask,
    "serve": cmd_serve,
    "config": cmd_config,
    "models": cmd_models,
    "status": cmd_status,
    "eval": cmd_eval,
    "calibrate": cmd_calibrate,
    "batch": cmd_batch,
    "train": cmd_train,
}


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record to `sys.stderr` as it is at that moment (tests replace it)."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


@contextmanager
def cli_logging(verbose: bool = False, quiet: bool = False) -> Iterator[None]:
    """selfrag's log records on stderr for one command: INFO and above, DEBUG and above when
    `verbose`, WARNING and above when `quiet`. Other libraries' loggers keep their own levels
    (their warnings still show). Undone when the command ends."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logger = logging.getLogger("selfrag")
    handler = _Stderr()
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s selfrag: %(levelname)s %(name)s: %(message)s"
            if verbose
            else "selfrag: %(levelname)s: %(message)s"
        )
    )
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


def main(argv: Sequence[str] | None = None) -> int:
    with terminal_safe_output():
        args = build_parser().parse_args(argv)
        with cli_logging(args.verbose, args.quiet):
            return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.command](args)
    except ValidationError as exc:
        from selfrag.infra.settings_loader import describe_validation_error

        print(f"selfrag: invalid request: {describe_validation_error(exc)}", file=sys.stderr)
    except AnswerError as exc:
        print(f"selfrag: {exc.kind.replace('_', ' ')}: {exc.detail}", file=sys.stderr)
        return EXIT_USAGE if exc.kind == "unprocessable" else EXIT_FAILED
    except (CLIError, ValueError, OSError) as exc:
        print(f"selfrag: {exc}", file=sys.stderr)
    except RecursionError as exc:
        # The readers refuse deep nesting themselves; this is the last line, never a traceback.
        print(f"selfrag: input nested too deeply to process ({exc})", file=sys.stderr)
    except RuntimeError as exc:
        from selfrag.infra.engine.cpu_builds.cpu_variants import BackendError
        from selfrag.infra.models.model_files import ModelFileError
        from selfrag.infra.store.qdrant_store import StoreError

        if not isinstance(exc, ModelFileError | BackendError | StoreError):
            raise
        print(f"selfrag: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("selfrag: interrupted", file=sys.stderr)
        return 130
    return EXIT_USAGE
