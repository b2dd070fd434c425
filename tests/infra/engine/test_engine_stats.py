"""infra/engine/engine_stats.py: a copy holds every counter and is independent of the
original; a reset zeroes every counter in place."""

from __future__ import annotations

from collections import Counter
from dataclasses import fields

from selfrag.infra.engine.engine_stats import EngineStats


def _busy() -> EngineStats:
    """Each counter set to a different value (so a counter copied into another shows)."""
    stats = EngineStats()
    for i, f in enumerate(fields(stats), start=1):
        setattr(stats, f.name, Counter({1: i, 4: 2 * i}) if f.name == "batch_sizes" else i)
    return stats


def test_a_copy_holds_every_counter_as_it_was():
    stats = _busy()
    copy = stats.copy()
    assert copy == stats
    assert {f.name: getattr(copy, f.name) for f in fields(copy)} == {
        f.name: getattr(stats, f.name) for f in fields(stats)
    }


def test_a_copy_does_not_move_with_the_engine():
    stats = _busy()
    copy = stats.copy()
    stats.prefill_tokens += 10
    stats.batch_sizes[8] += 1
    assert copy.prefill_tokens == stats.prefill_tokens - 10
    assert 8 not in copy.batch_sizes


def test_reset_zeroes_every_counter_in_place():
    stats = _busy()
    held = stats
    stats.reset()
    assert held is stats
    assert stats == EngineStats()
    assert isinstance(stats.batch_sizes, Counter) and not stats.batch_sizes
