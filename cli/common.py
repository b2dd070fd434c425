"""Exit codes, the user-fixable error, and the settings a command runs with."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from selfrag.schemas.settings import Settings

EXIT_USAGE = 2
EXIT_PARTIAL = 1
EXIT_FAILED = 1


class CLIError(Exception):
    """A problem the user can fix; printed without a traceback."""


def model_override(value: str) -> dict[str, Any]:
    """The `model` settings `--model VALUE` means: a preset by name, else a GGUF path or URL."""
    from selfrag.infra.models.model_presets import PRESETS

    if value in PRESETS:
        return {"preset": value, "path": None}
    if value.startswith(("http://", "https://")) or Path(value).expanduser().exists():
        return {"path": value}
    raise CLIError(
        f"--model {value}: neither a model preset ({', '.join(PRESETS)}) nor an existing file"
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings of a command: the files and environment, then `--home` and `--model`."""
    from selfrag.infra.settings_loader import load_settings

    overrides: dict[str, Any] = {}
    if args.home is not None:
        overrides["home"] = str(args.home)
    if getattr(args, "model", None) is not None:
        overrides["model"] = model_override(args.model)
    if getattr(args, "collection", None) is not None:
        overrides["retrieval"] = {"collection": args.collection}
    return load_settings(config_path=args.config, overrides=overrides)


def question_limit(args: argparse.Namespace) -> int | None:
    if args.limit is not None and args.limit < 1:
        raise CLIError("--limit must be at least 1")
    return args.limit
