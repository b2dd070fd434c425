"""pipeline/learning/logistic_fit.py: the logistic fit recovers known parameters, stays finite
on separable data, refuses bad input, and the AUC and sigmoid it rests on."""

from __future__ import annotations

import math
import random

import pytest

from selfrag.pipeline.learning.logistic_fit import (
    auc,
    auc_standard_error,
    fit_logistic,
    sigmoid,
)


def test_the_fit_recovers_the_parameters_that_generated_the_labels():
    rng = random.Random(7)
    xs = [rng.uniform(-3.0, 3.0) for _ in range(4000)]
    ys = [rng.random() < sigmoid(1.5 * x - 0.5) for x in xs]
    params = fit_logistic(xs, ys)
    assert params.a == pytest.approx(1.5, abs=0.2)
    assert params.b == pytest.approx(-0.5, abs=0.15)


def test_separable_data_gives_finite_parameters_that_separate_it():
    xs = [-2.0, -1.0, -0.5, 0.5, 1.0, 2.0]
    ys = [0, 0, 0, 1, 1, 1]
    params = fit_logistic(xs, ys)
    assert math.isfinite(params.a) and math.isfinite(params.b) and params.a > 0
    probs = [sigmoid(params.a * x + params.b) for x in xs]
    assert all(p < 0.5 for p in probs[:3]) and all(p > 0.5 for p in probs[3:])


def test_one_class_gives_a_flat_fit_at_the_smoothed_base_rate():
    params = fit_logistic([0.1, 0.5, 0.9], [1, 1, 1])
    assert params.a == 0.0
    assert sigmoid(params.b) == pytest.approx(3.5 / 4.0)


def test_mismatched_or_empty_input_is_refused():
    with pytest.raises(ValueError, match="2 signals but 1 labels"):
        fit_logistic([0.0, 1.0], [1])
    with pytest.raises(ValueError, match="no samples"):
        fit_logistic([], [])


def test_auc_counts_wins_and_half_ties_and_needs_both_classes():
    assert auc([0.9, 0.8, 0.1, 0.2], [1, 1, 0, 0]) == 1.0
    assert auc([0.1, 0.2, 0.9, 0.8], [1, 1, 0, 0]) == 0.0
    assert auc([0.5, 0.5], [1, 0]) == 0.5
    assert auc([0.9, 0.3, 0.5], [1, 0, 1]) == 1.0
    assert auc([0.9, 0.3], [1, 1]) is None


def test_auc_standard_error_is_the_rank_sum_null_at_one_half_and_matches_resampling():
    # At AUC 0.5 the formula is the Mann-Whitney statistic's null variance.
    assert auc_standard_error(0.5, 30, 50) == pytest.approx(math.sqrt(81 / (12 * 30 * 50)))
    # Against the spread of AUCs over repeated samples of two shifted normal classes.
    rng = random.Random(3)
    areas = []
    for _ in range(300):
        pos = [rng.gauss(1.2, 1.0) for _ in range(40)]
        neg = [rng.gauss(0.0, 1.0) for _ in range(50)]
        areas.append(auc(pos + neg, [True] * 40 + [False] * 50))
    mean = sum(areas) / len(areas)
    spread = math.sqrt(sum((a - mean) ** 2 for a in areas) / (len(areas) - 1))
    assert auc_standard_error(mean, 40, 50) == pytest.approx(spread, rel=0.2)
    assert auc_standard_error(0.9, 400, 500) < auc_standard_error(0.9, 40, 50)
    with pytest.raises(ValueError, match="both classes"):
        auc_standard_error(0.9, 0, 5)


def test_sigmoid_is_symmetric_and_does_not_overflow():
    assert sigmoid(0.0) == 0.5
    assert sigmoid(2.0) == pytest.approx(1.0 - sigmoid(-2.0))
    assert sigmoid(1000.0) == 1.0 and sigmoid(-1000.0) == 0.0
