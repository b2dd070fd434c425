"""The thread count of each llama.cpp call (`infra.engine.llama_threads.ThreadChooser`)."""

from __future__ import annotations

from selfrag.infra.engine.llama_threads import CHOSEN_MAX_TOKENS, ThreadChooser, size_class


def run(chooser: ThreadChooser, n_tokens: int, seconds: dict[int, float], calls: int) -> list[int]:
    """`calls` calls of `n_tokens` tokens, each taking `seconds[threads]`; the threads chosen."""
    chosen = []
    for _ in range(calls):
        t = chooser.choose(n_tokens)
        chooser.record(n_tokens, t, seconds[t])
        chosen.append(t)
    return chosen


def run_reading(
    chooser: ThreadChooser, n_tokens: int, seconds: dict[int, float], calls: int
) -> list[int]:
    """As `run`, for calls that read hidden states."""
    chosen = []
    for _ in range(calls):
        t = chooser.choose(n_tokens, reads=True)
        chooser.record(n_tokens, t, seconds[t], reads=True)
        chosen.append(t)
    return chosen


def test_size_classes_are_exact_up_to_8_then_powers_of_two() -> None:
    assert [size_class(n) for n in range(1, 9)] == list(range(1, 9))
    assert size_class(9) == size_class(16) != size_class(17) == size_class(32)
    assert size_class(33) == size_class(64)


def test_measures_both_then_keeps_the_faster() -> None:
    chooser = ThreadChooser(2, warmup=3, recheck=32)
    chosen = run(chooser, 3, {1: 0.010, 2: 0.030}, calls=20)
    assert sorted(chosen[:6]) == [1, 1, 1, 2, 2, 2]  # both candidates measured first
    assert set(chosen[6:]) == {1}
    assert chooser.chosen() == {3: 1}
    # A larger size class is measured on its own.
    chosen = run(chooser, 8, {1: 0.040, 2: 0.020}, calls=20)
    assert sorted(chosen[:6]) == [1, 1, 1, 2, 2, 2]
    assert set(chosen[6:]) == {2}
    assert chooser.chosen() == {3: 1, 8: 2}


def test_classes_beyond_a_measured_crossing_follow_it_unmeasured() -> None:
    chooser = ThreadChooser(2, warmup=2, recheck=1000)
    run(chooser, 2, {1: 0.010, 2: 0.030}, calls=4)  # one thread wins at 2 tokens
    run(chooser, 4, {1: 0.050, 2: 0.030}, calls=4)  # all threads win at 4
    # Larger calls never try one thread (a long prompt would pay ~2x), smaller ones never two.
    assert run(chooser, 40, {2: 0.3}, calls=5) == [2] * 5
    assert run(chooser, 1, {1: 0.005}, calls=5) == [1] * 5
    # Between the two, and for the other kind of call, nothing is known: measured.
    assert sorted(run(chooser, 3, {1: 0.02, 2: 0.02}, calls=4)) == [1, 1, 2, 2]
    assert sorted(run_reading(chooser, 40, {1: 0.5, 2: 0.3}, calls=4)) == [1, 1, 2, 2]
    assert chooser.chosen() == {2: 1, 3: 1, 4: 2}


def test_classes_between_disagreeing_measurements_are_measured() -> None:
    chooser = ThreadChooser(2, warmup=2, recheck=1000)
    for threads, seconds in ((1, 0.050), (2, 0.030)) * 2:  # all threads won at 2 tokens...
        chooser.record(2, threads, seconds)
    for threads, seconds in ((1, 0.030), (2, 0.050)) * 2:  # ...one thread at 8 (a change of load)
        chooser.record(8, threads, seconds)
    assert sorted(run(chooser, 5, {1: 0.02, 2: 0.03}, calls=4)) == [1, 1, 2, 2]


def test_rechecks_the_other_and_follows_a_change_of_load() -> None:
    chooser = ThreadChooser(2, warmup=2, recheck=8, keep=3)
    run(chooser, 2, {1: 0.010, 2: 0.030}, calls=10)
    # Another process takes a core: one thread is now slower than two.
    chosen = run(chooser, 2, {1: 0.060, 2: 0.030}, calls=40)
    assert chosen[-16:].count(2) == 14  # one recheck of one thread in every 8 calls
    assert chooser.chosen() == {2: 2}


def test_one_slow_call_does_not_decide() -> None:
    chooser = ThreadChooser(2, warmup=3)
    for seconds in (0.010, 0.500, 0.010):  # the second one-thread call hit a stall
        chooser.record(1, 1, seconds)
    for _ in range(3):
        chooser.record(1, 2, 0.020)
    assert chooser.choose(1) == 1


def test_large_calls_and_single_thread_or_fixed_engines_never_choose() -> None:
    chooser = ThreadChooser(4)
    assert run(chooser, CHOSEN_MAX_TOKENS + 1, {4: 1.0}, calls=10) == [4] * 10
    assert chooser.chosen() == {}
    assert run(ThreadChooser(1), 1, {1: 1.0}, calls=5) == [1] * 5
    fixed = ThreadChooser(2, adaptive=False)
    assert run(fixed, 1, {2: 1.0}, calls=10) == [2] * 10
    assert fixed.candidates == (2,)


def test_calls_that_read_hidden_states_are_classed_apart() -> None:
    chooser = ThreadChooser(2, warmup=2)
    for _ in range(4):  # plain steps: one thread is faster
        t = chooser.choose(3)
        chooser.record(3, t, {1: 0.010, 2: 0.030}[t])
    for _ in range(4):  # the same size with hidden states out: two threads are faster
        t = chooser.choose(3, reads=True)
        chooser.record(3, t, {1: 0.090, 2: 0.040}[t], reads=True)
    assert chooser.choose(3) == 1
    assert chooser.choose(3, reads=True) == 2
    assert chooser.chosen() == {3: 1}
