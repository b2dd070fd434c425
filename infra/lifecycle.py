"""A mixin for components that own resources released by `close()`."""

from __future__ import annotations

from typing import Self


class Closeable:
    """Adds `with` support to a class that defines `close()`."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
