"""Fitting the reflection heads on hidden states: each group a multinomial logistic regression
without bias (rows of the output matrix, `pipeline.heads`), balanced over its labels, its L2
strength chosen on a validation split held out by passage or question (`fit_heads`): the
strongest L2 whose validation AUC is within one standard error of the best (`chosen_l2`)."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import minimize

from selfrag.pipeline.heads import GROUP_LABELS
from selfrag.pipeline.learning.logistic_fit import auc, auc_standard_error
from selfrag.pipeline.learning.reflection_data import Example
from selfrag.pipeline.scoring import (
    relevance_score,
    retrieval_probability,
    support_score,
    utility_score,
)

L2_GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
VALIDATION_SHARE = 0.2
# The labels whose score separation the validation AUC measures, per group.
CONTRAST = {
    "retrieve": ("yes", "no"),
    "relevance": ("relevant", "irrelevant"),
    "support": ("full", "none"),
    "utility": ("5", "1"),
}
SCORE = {
    "retrieve": retrieval_probability,
    "relevance": relevance_score,
    "support": support_score,
    "utility": utility_score,
}


def fit_softmax(
    X: np.ndarray, y: np.ndarray, n_labels: int, l2: float, sample_weight: np.ndarray
) -> np.ndarray:
    """Weights (n_labels × d) of softmax(W·x) without bias: weighted cross-entropy + l2/2·|W|².

    Features are scaled per dimension (not centred, which would need a bias) for the fit and
    the scale folded back into W.
    """
    scale = np.sqrt((X.astype(np.float64) ** 2).mean(axis=0)) + 1e-6
    Z = X / scale
    Y = np.eye(n_labels)[y]
    w = sample_weight / sample_weight.sum()
    d = Z.shape[1]

    def loss(flat: np.ndarray) -> tuple[float, np.ndarray]:
        W = flat.reshape(n_labels, d)
        logits = Z @ W.T
        logits -= logits.max(axis=1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        value = -(w * (Y * log_p).sum(axis=1)).sum() + 0.5 * l2 * (W * W).sum()
        grad = (np.exp(log_p) - Y).T @ (Z * w[:, None]) + l2 * W
        return float(value), grad.ravel()

    result = minimize(
        loss, np.zeros(n_labels * d), jac=True, method="L-BFGS-B", options={"maxiter": 500}
    )
    return result.x.reshape(n_labels, d) / scale


def probabilities(W: np.ndarray, X: np.ndarray, labels: Sequence[str]) -> list[dict[str, float]]:
    z = X.astype(np.float64) @ W.T.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return [dict(zip(labels, row.tolist(), strict=True)) for row in p]


def group_auc(group: str, W: np.ndarray, X: np.ndarray, labels: Sequence[str]) -> float | None:
    """AUC of the group's score (p_ret, s_rel, s_sup, s_use) for its two contrasted labels."""
    positive, negative = CONTRAST[group]
    keep = [i for i, label in enumerate(labels) if label in (positive, negative)]
    if not keep:
        return None
    probs = probabilities(W, X[keep], GROUP_LABELS[group])
    return auc([SCORE[group](p) for p in probs], [labels[i] == positive for i in keep])


def lowered(W: np.ndarray, X: np.ndarray, ceiling: float = -10.0) -> tuple[np.ndarray, float]:
    """W with every row moved by the same vector −c·μ̂ (μ̂: the mean hidden-state direction) so
    that no row's logit exceeds `ceiling` on the training states. Within-group probabilities
    do not change (softmax ignores a shift common to a group), but as rows of an exported
    output matrix the reflection tokens then stay far below ordinary tokens (whose top logit is
    ~8-25 for SmolLM2) and never interrupt generated text. Returns W and c."""
    mu = X.astype(np.float64).mean(axis=0)
    mu_hat = mu / (np.linalg.norm(mu) + 1e-12)
    along = X.astype(np.float64) @ mu_hat
    if along.min() <= 0.0:
        return W, 0.0  # no direction every state shares: leave the rows as they are
    top = (X.astype(np.float64) @ W.T).max(axis=1)
    c = max(float(((top - ceiling) / along).max()), 0.0)
    return W - c * mu_hat[None, :], c


def chosen_l2(tried: dict[float, float | None], standard_error: float) -> float:
    """The strongest L2 whose validation AUC in `tried` is within `standard_error` of the best
    one (the one-standard-error rule). A weaker L2 buys the last hundredths of validation AUC
    with larger weights, and a head's score moves with its weights' norm whenever the hidden
    state does: llama.cpp's state for one prompt changes with how its decode calls split it.
    The strongest L2 when no AUC could be measured."""
    measured = [a for a in tried.values() if a is not None]
    if not measured:
        return max(tried)
    floor = max(measured) - standard_error
    return max(l2 for l2, a in tried.items() if a is not None and a >= floor)


def is_validation(key: str, seed: int) -> bool:
    """Whether the example about `key` is in the validation split (a fixed share, by key)."""
    return zlib.crc32(f"{seed}:{key}".encode()) % 1000 < VALIDATION_SHARE * 1000


@dataclass(frozen=True)
class GroupData:
    """One group's examples and hidden states, with their labels, balancing weights and
    validation split, as `fit_heads` fits them."""

    group: str
    examples: list[Example]
    X: np.ndarray
    y: np.ndarray
    """Label indices into `GROUP_LABELS[group]`."""
    weights: np.ndarray
    """Per example, one over its label's count: every label weighs alike."""
    validation: np.ndarray
    """Per example, whether it is in the validation split (`is_validation`)."""

    @classmethod
    def of(cls, group: str, examples: Sequence[Example], X: np.ndarray, seed: int) -> GroupData:
        """The examples of `group` among `examples`, with their rows of `X`."""
        labels = GROUP_LABELS[group]
        idx = [i for i, ex in enumerate(examples) if ex.group == group]
        y = np.array([labels.index(examples[i].label) for i in idx])
        present = Counter(y.tolist())
        return cls(
            group,
            [examples[i] for i in idx],
            X[idx],
            y,
            np.array([1.0 / present[v] for v in y]),
            np.array([is_validation(examples[i].key, seed) for i in idx]),
        )

    def fit_training(self, l2: float) -> np.ndarray:
        """Weights fitted on the training split (`fit_softmax`)."""
        train = ~self.validation
        return fit_softmax(
            self.X[train], self.y[train], len(GROUP_LABELS[self.group]), l2, self.weights[train]
        )

    def validation_auc(self, W: np.ndarray, X: np.ndarray | None = None) -> float | None:
        """`group_auc` of `W` on the validation split, read from `X` (rows as this data's;
        default: its own hidden states)."""
        rows = self.X if X is None else X
        return group_auc(self.group, W, rows[self.validation], self.validation_labels())

    def validation_labels(self) -> list[str]:
        """The labels of the validation split's examples, in order."""
        return [ex.label for ex, v in zip(self.examples, self.validation, strict=True) if v]

    def validation_auc_error(self, area: float | None) -> float:
        """The standard error of a validation AUC of `area` on this data's validation split
        (0 when it has no AUC)."""
        positive, negative = CONTRAST[self.group]
        names = self.validation_labels()
        n_pos, n_neg = names.count(positive), names.count(negative)
        if area is None or not n_pos or not n_neg:
            return 0.0
        return auc_standard_error(area, n_pos, n_neg)


def fit_heads(
    examples: Sequence[Example], X: np.ndarray, seed: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Per group: choose L2 on the validation split (`chosen_l2`), refit on all examples.
    Returns the weights (rounded to float16, the precision an exported output matrix keeps)
    and statistics."""
    weights: dict[str, np.ndarray] = {}
    stats: dict[str, Any] = {}
    for group, labels in GROUP_LABELS.items():
        data = GroupData.of(group, examples, X, seed)
        tried = {l2: data.validation_auc(data.fit_training(l2)) for l2 in L2_GRID}
        top = max((a for a in tried.values() if a is not None), default=None)
        error = data.validation_auc_error(top)
        chosen = chosen_l2(tried, error)
        W = fit_softmax(data.X, data.y, len(labels), chosen, data.weights)
        W, shift = lowered(W, X)
        weights[group] = W.astype(np.float16).astype(np.float32)
        stats[group] = {
            "examples": len(data.y),
            "labels": {label: int((data.y == k).sum()) for k, label in enumerate(labels)},
            "sources": dict(Counter(ex.source for ex in data.examples)),
            "validation_examples": int(data.validation.sum()),
            "validation_auc": tried[chosen],
            "l2": chosen,
            "validation_auc_best": top,
            "validation_auc_error": error,
            "l2_grid_auc": {str(k): v for k, v in tried.items()},
            "shift": shift,
        }
    return weights, stats
