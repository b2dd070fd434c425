"""Fitting the logistic calibration p = sigmoid(a·x + b) of a likelihood signal (pure Python)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from selfrag.schemas.calibration import LogisticParams


def fit_logistic(
    xs: Sequence[float], ys: Sequence[int | bool], *, l2: float = 1e-3, iterations: int = 100
) -> LogisticParams:
    """Maximum-likelihood (a, b) by Newton's method, with a small L2 penalty on `a` so that
    perfectly separable data still gives finite parameters.

    Raises ValueError for mismatched or empty input. With a single class the slope is 0 and the
    intercept matches the (smoothed) base rate.
    """
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} signals but {len(ys)} labels")
    if not xs:
        raise ValueError("no samples to fit")
    n = len(xs)
    positives = sum(1 for y in ys if y)
    if positives in (0, n):
        rate = (positives + 0.5) / (n + 1.0)
        return LogisticParams(a=0.0, b=math.log(rate / (1.0 - rate)))
    a, b = 0.0, math.log(positives / (n - positives))
    for _ in range(iterations):
        ga, gb = -l2 * n * a, 0.0
        haa, hab, hbb = l2 * n, 0.0, 0.0
        for x, y in zip(xs, ys, strict=True):
            p = sigmoid(a * x + b)
            r = float(bool(y)) - p
            w = p * (1.0 - p)
            ga += r * x
            gb += r
            haa += w * x * x
            hab += w * x
            hbb += w
        det = haa * hbb - hab * hab
        if det <= 1e-12:
            break
        da = (hbb * ga - hab * gb) / det
        db = (haa * gb - hab * ga) / det
        a, b = a + da, b + db
        if abs(da) < 1e-9 and abs(db) < 1e-9:
            break
    return LogisticParams(a=max(min(a, 1000.0), -1000.0), b=max(min(b, 1000.0), -1000.0))


def auc(xs: Sequence[float], ys: Sequence[int | bool]) -> float | None:
    """Area under the ROC curve of `xs` as a score for `ys` (ties count half); None when one
    class is missing."""
    pos = [x for x, y in zip(xs, ys, strict=True) if y]
    neg = [x for x, y in zip(xs, ys, strict=True) if not y]
    if not pos or not neg:
        return None
    wins = 0.0
    for p in pos:
        for q in neg:
            wins += 1.0 if p > q else 0.5 if p == q else 0.0
    return wins / (len(pos) * len(neg))


def auc_standard_error(area: float, n_pos: int, n_neg: int) -> float:
    """The standard error of an AUC of `area` measured on `n_pos` positives and `n_neg`
    negatives (Hanley and McNeil, 1982)."""
    if n_pos < 1 or n_neg < 1:
        raise ValueError(f"an AUC needs both classes, got {n_pos} and {n_neg}")
    q1 = area / (2.0 - area)
    q2 = 2.0 * area * area / (1.0 + area)
    variance = (
        area * (1.0 - area) + (n_pos - 1) * (q1 - area * area) + (n_neg - 1) * (q2 - area * area)
    ) / (n_pos * n_neg)
    return math.sqrt(max(variance, 0.0))


def sigmoid(z: float) -> float:
    """1 / (1 + e^−z), without overflow for large |z|."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)
