"""The thread count of each llama.cpp call (`infra.llama_threads.ThreadChooser`)."""

from __future__ import annotations

from selfrag.infra.llama_threads import CHOSEN_MAX_TOKENS, ThreadChooser, size_class


def run(chooser: ThreadChooser, n_tokens: int, seconds: dict[int, float], calls: int) -> list[int]:
    """`calls` calls of `n_tokens` tokens, each taking `seconds[threads]`; the threads chosen."""
    chosen = []
    for _ in range(calls):
        t = chooser.choose(n_tokens)
        chooser.record(n_tokens, t, seconds[t])
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
    # Another size class is measured on its own.
    chosen = run(chooser, 1, {1: 0.040, 2: 0.020}, calls=20)
    assert set(chosen[6:]) == {2}
    assert chooser.chosen() == {1: 2, 3: 1}


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
