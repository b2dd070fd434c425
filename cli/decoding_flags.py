"""The per-request decoding dials as command-line flags, one per `DecodingOverrides` field."""

from __future__ import annotations

import argparse
import typing
from typing import Any

from selfrag.schemas.decoding import DecodingOverrides


class _NamedScores(argparse.Action):
    """A repeated NAME=SCORE flag, gathered into one {name: score} mapping (validated with the
    rest of the request)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        name, sep, score = str(values).rpartition("=")
        try:
            value = float(score)
        except ValueError:
            value = None
        if not sep or value is None:
            parser.error(f"{option_string}: expected NAME=SCORE, got {values!r}")
        scores = dict(getattr(namespace, self.dest) or {})
        scores[name] = value
        setattr(namespace, self.dest, scores)


def add_decoding_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `DecodingOverrides` field, so the CLI and the API share their dials."""
    group = parser.add_argument_group("decoding (per request; defaults from `selfrag config`)")
    for name, field in DecodingOverrides.model_fields.items():
        flag = "--" + name.replace("_", "-")
        inner = [a for a in typing.get_args(field.annotation) if a is not type(None)]
        kind = inner[0] if inner else field.annotation
        help_text = field.description or ""
        if kind is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif typing.get_origin(kind) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(kind), default=None, help=help_text)
        elif kind in (int, float, str):
            group.add_argument(flag, type=kind, default=None, help=help_text)
        elif typing.get_origin(kind) is dict:
            group.add_argument(
                flag, action=_NamedScores, metavar="NAME=SCORE", default=None, help=help_text
            )
        else:  # pragma: no cover - guards new field types
            raise TypeError(f"no CLI flag type for {name}: {kind}")
