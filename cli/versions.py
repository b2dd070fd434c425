"""`selfrag --version`: the versions of selfrag and of the engines it runs on."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class VersionAction(argparse.Action):
    """`--version`: `version_text()` as it is, two lines (argparse's own action rewraps it)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(version_text())
        parser.exit()


def version_text() -> str:
    """`selfrag --version`: this package's version, then llama-cpp-python's and Ray's."""

    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    engines = f"llama-cpp-python {of('llama-cpp-python')}, ray {of('ray')}"
    return f"selfrag {selfrag_version()}\n{engines}"


def selfrag_version() -> str:
    """selfrag's installed version, as `selfrag.__version__` reads it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("selfrag")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
