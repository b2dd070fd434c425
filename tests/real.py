"""Which tests run a real component: the ones that use a fixture that starts one.

A fixture that starts a real component (the llama.cpp model, Qdrant, Redis, Ray, Serve,
Chromium, a `selfrag` process that loads a model) is decorated with `@real`, under its
`@pytest.fixture`. Every test that uses such a fixture, directly or through another fixture,
gets the `real` marker from `tests/conftest.py`, so `scripts/test.sh --fast` (`-m "not real"`)
leaves it out. Nothing marks a test by hand: a test that loads the model itself asks for the
`llama_model` fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])

REAL = "starts_real"


def real(fixture: F) -> F:
    """Mark a fixture function as one that starts a real component."""
    setattr(fixture, REAL, True)
    return fixture


def _starts_real(func: Callable[..., Any]) -> bool:
    while func is not None:
        if getattr(func, REAL, False):
            return True
        func = getattr(func, "__wrapped__", None)
    return False


def uses_real_component(item: pytest.Item) -> bool:
    """Whether `item` uses a fixture marked `@real`, directly or through other fixtures (the
    fixture closure: the definition each name resolves to for this test)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and _starts_real(defs[-1].func) for defs in info.name2fixturedefs.values())
