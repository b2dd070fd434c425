from collections.abc import Callable

import pytest

from selfrag.pipeline.timings import add_timings, timed


def ticking(*readings: float) -> Callable[[], float]:
    it = iter(readings)
    return lambda: next(it)


def test_timed_adds_the_blocks_milliseconds_to_its_stage_across_calls():
    timings: dict[str, float] = {"rank": 1.0}
    clock = ticking(10.0, 10.25, 20.0, 20.5)
    with timed(timings, "draft", clock):
        pass
    with timed(timings, "draft", clock):
        pass
    assert timings == {"rank": 1.0, "draft": pytest.approx(750.0)}


def test_timed_counts_a_block_that_raises():
    timings: dict[str, float] = {}
    with pytest.raises(ValueError), timed(timings, "retrieve", ticking(1.0, 1.002)):
        raise ValueError("search failed")
    assert timings == {"retrieve": pytest.approx(2.0)}


def test_add_timings_sums_stage_by_stage():
    timings = {"draft": 5.0}
    add_timings(timings, {"draft": 2.5, "critique": 1.0})
    assert timings == {"draft": 7.5, "critique": 1.0}
