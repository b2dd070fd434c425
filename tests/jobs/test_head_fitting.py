"""Fitting the reflection heads: the softmax regression, the L2 choice on the validation split.

These are properties of the fitting math on synthetic data, not accuracy claims for a model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from selfrag.jobs.head_fitting import (
    L2_GRID,
    GroupData,
    chosen_l2,
    fit_heads,
    fit_softmax,
    group_auc,
    probabilities,
)
from selfrag.pipeline.critics import Branch
from selfrag.pipeline.heads import GROUP_LABELS
from selfrag.pipeline.learning.reflection_data import Example

DIM = 6


def blobs(
    rng: np.random.Generator, per_label: int, label_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Well separated clusters, label k around 3·e_k, with a constant last feature (no bias in
    the model, so the constant lets a row act as one)."""
    xs, ys = [], []
    for k in label_ids:
        mu = np.zeros(DIM)
        mu[k] = 3.0
        x = rng.normal(size=(per_label, DIM)) * 0.7 + mu
        x[:, -1] = 1.0
        xs.append(x)
        ys += [k] * per_label
    return np.vstack(xs).astype(np.float32), np.array(ys)


def test_fit_softmax_separates_clearly_separable_blobs_on_held_out_data() -> None:
    rng = np.random.default_rng(0)
    X, y = blobs(rng, 40, [0, 1])
    Xt, yt = blobs(rng, 40, [0, 1])
    labels = GROUP_LABELS["relevance"]
    W = fit_softmax(X, y, len(labels), 0.01, np.ones(len(y)))
    assert W.shape == (2, DIM)
    np.testing.assert_array_equal(W, fit_softmax(X, y, len(labels), 0.01, np.ones(len(y))))
    names = [labels[k] for k in yt]
    a = group_auc("relevance", W, Xt, names)
    assert a is not None and a > 0.9
    # Swapping the labels' rows turns the score around: the AUC measures the head, not chance.
    swapped = group_auc("relevance", W[::-1], Xt, names)
    assert swapped is not None and swapped < 0.1
    # Only one contrasted label present: no AUC.
    assert group_auc("relevance", W, Xt[yt == 0], [labels[0]] * int((yt == 0).sum())) is None


def test_fit_softmax_gives_a_label_without_examples_low_probability() -> None:
    rng = np.random.default_rng(1)
    labels = GROUP_LABELS["support"]  # full, partial, none; no "partial" example
    X, y = blobs(rng, 40, [0, 2])
    Xt, _ = blobs(rng, 40, [0, 2])
    W = fit_softmax(X, y, len(labels), 0.01, np.ones(len(y)))
    probs = probabilities(W, Xt, labels)
    assert all(sum(p.values()) == pytest.approx(1.0) for p in probs)
    assert max(p["partial"] for p in probs) < 0.2
    assert np.mean([p["partial"] for p in probs]) < 0.05
    assert np.mean([max(p["full"], p["none"]) for p in probs]) > 0.8


def test_fit_softmax_sample_weights_balance_the_labels() -> None:
    rng = np.random.default_rng(2)
    # Overlapping classes, one five times as common: unweighted, the common label wins more.
    X, y = blobs(rng, 100, [0, 1])
    X[:, :2] *= 0.15
    keep = np.r_[np.arange(100), np.arange(100, 120)]
    X, y = X[keep], y[keep]
    uniform = fit_softmax(X, y, 2, 0.01, np.ones(len(y)))
    balanced = fit_softmax(X, y, 2, 0.01, np.where(y == 0, 1 / 100, 1 / 20))
    p_uniform = np.mean([p["irrelevant"] for p in probabilities(uniform, X, ("r", "irrelevant"))])
    p_balanced = np.mean([p["irrelevant"] for p in probabilities(balanced, X, ("r", "irrelevant"))])
    assert p_balanced > p_uniform


# --- fit_heads and check_counts ----------------------------------------------------------------


def synthetic_examples(
    rng: np.random.Generator, per_label: dict[str, dict[str, int]]
) -> tuple[list[Example], np.ndarray]:
    """Examples of every group with features that cluster by label."""
    examples: list[Example] = []
    rows: list[np.ndarray] = []
    branch = Branch("q", "", None)
    for group, counts in per_label.items():
        labels = GROUP_LABELS[group]
        for label, n in counts.items():
            k = labels.index(label)
            for i in range(n):
                x = rng.normal(size=DIM) * 1.5  # overlapping: the fit converges fast
                x[k % (DIM - 1)] += 3.0
                x[-1] = 1.0
                rows.append(x)
                examples.append(
                    Example(group, label, branch, source=f"src-{label}", key=f"{group}-{label}-{i}")
                )
    return examples, np.array(rows, dtype=np.float32)


ENOUGH = {
    "retrieve": {"yes": 25, "no": 25},
    "relevance": {"relevant": 30, "irrelevant": 30},
    "support": {"full": 20, "partial": 10, "none": 20},
    "utility": {"5": 25, "1": 25},
}


def test_fit_heads_returns_float16_representable_weights_and_counts_per_label() -> None:
    examples, X = synthetic_examples(np.random.default_rng(3), ENOUGH)
    weights, stats = fit_heads(examples, X, seed=0)
    assert set(weights) == set(stats) == set(GROUP_LABELS)
    for group, labels in GROUP_LABELS.items():
        W = weights[group]
        assert W.shape == (len(labels), DIM) and W.dtype == np.float32
        np.testing.assert_array_equal(W.astype(np.float16).astype(np.float32), W)
        assert np.abs(W).max() > 0  # a fitted head, not the zero start
        s = stats[group]
        expected = {label: ENOUGH[group].get(label, 0) for label in labels}
        assert s["labels"] == expected
        assert s["examples"] == sum(expected.values())
        assert s["sources"] == {f"src-{k}": v for k, v in ENOUGH[group].items()}
        assert 0 < s["validation_examples"] < s["examples"]
        assert s["l2"] in L2_GRID
        assert set(s["l2_grid_auc"]) == {str(v) for v in L2_GRID}
        assert s["validation_auc"] == s["l2_grid_auc"][str(s["l2"])]
        assert s["validation_auc_error"] >= 0
        assert (
            s["validation_auc_best"] - s["validation_auc_error"]
            <= s["validation_auc"]
            <= s["validation_auc_best"]
            == max(s["l2_grid_auc"].values())
        )


def test_group_data_holds_one_groups_examples_and_fits_as_fit_heads_does() -> None:
    examples, X = synthetic_examples(np.random.default_rng(3), ENOUGH)
    data = GroupData.of("relevance", examples, X, seed=0)
    assert [ex.group for ex in data.examples] == ["relevance"] * 60
    assert data.X.shape == (60, DIM) and data.y.tolist() == [0] * 30 + [1] * 30
    np.testing.assert_allclose(data.weights, 1 / 30)
    assert 0 < data.validation.sum() < 60
    _, stats = fit_heads(examples, X, seed=0)
    tried = {str(l2): data.validation_auc(data.fit_training(l2)) for l2 in L2_GRID}
    assert tried == stats["relevance"]["l2_grid_auc"]
    # Read from other rows of the same examples: the AUC of those rows.
    W = data.fit_training(0.1)
    flipped = data.X.copy()
    flipped[:, [0, 1]] = flipped[:, [1, 0]]
    assert data.validation_auc(W, flipped) < 0.5 < data.validation_auc(W)


def test_the_chosen_l2_is_the_strongest_within_one_standard_error_of_the_best() -> None:
    tried: dict[float, float | None] = {0.01: 0.907, 0.03: 0.914, 0.3: 0.894, 1.0: 0.864}
    assert chosen_l2(tried, 0.033) == 0.3
    assert chosen_l2(tried, 0.0) == 0.03
    assert chosen_l2(tried, 0.1) == 1.0
    assert chosen_l2({0.1: None, 0.3: 0.7, 1.0: None}, 0.05) == 0.3
    assert chosen_l2({0.1: None, 3.0: None}, 0.05) == 3.0
