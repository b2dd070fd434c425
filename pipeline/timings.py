"""Stage timings: the milliseconds each named stage of an answer took, summed over its calls."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def timed(timings: dict[str, float], stage: str, clock: Callable[[], float]) -> Iterator[None]:
    """Add the milliseconds the block takes, by `clock` (seconds), to `timings[stage]`."""
    start = clock()
    try:
        yield
    finally:
        add_timings(timings, {stage: (clock() - start) * 1e3})


def add_timings(timings: dict[str, float], more: Mapping[str, float]) -> None:
    """Add each stage's milliseconds of `more` to `timings`."""
    for stage, ms in more.items():
        timings[stage] = timings.get(stage, 0.0) + ms
