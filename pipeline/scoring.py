"""The Self-RAG reflection scores (Asai et al., 2023) as pure functions.

Each takes the probabilities of a reflection group's labels. A label the model cannot
emit counts as probability 0; a group with no probability mass at all yields the neutral
value documented on each function instead of NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

UTILITY_WEIGHTS: tuple[float, ...] = (-1.0, -0.5, 0.0, 0.5, 1.0)
SUPPORT_LABELS = ("full", "partial", "none")
SupportLabel = Literal["full", "partial", "none"]


def _p(probs: Mapping[str, float], label: str) -> float:
    value = float(probs.get(label, 0.0))
    if math.isnan(value) or value < 0.0:
        return 0.0
    return value


def retrieval_probability(probs: Mapping[str, float]) -> float:
    """p_ret = p(yes) / (p(yes) + p(no)); 0.5 when neither has mass."""
    yes, no = _p(probs, "yes"), _p(probs, "no")
    total = yes + no
    return yes / total if total > 0.0 else 0.5


def should_retrieve(p_ret: float, threshold: float) -> bool:
    """Adaptive retrieval fires when p_ret exceeds δ."""
    return p_ret > threshold


def relevance_score(probs: Mapping[str, float]) -> float:
    """s_rel = p(relevant) / (p(relevant) + p(irrelevant)); 0.5 when neither has mass."""
    rel, irrel = _p(probs, "relevant"), _p(probs, "irrelevant")
    total = rel + irrel
    return rel / total if total > 0.0 else 0.5


def support_score(probs: Mapping[str, float]) -> float:
    """s_sup = (p(full) + 0.5·p(partial)) / (p(full) + p(partial) + p(none)); 0 without mass."""
    full, partial, none = (_p(probs, label) for label in SUPPORT_LABELS)
    total = full + partial + none
    return (full + 0.5 * partial) / total if total > 0.0 else 0.0


SUPPORT_THRESHOLD_SCORE = "threshold:s_sup*similarity"
"""Names the number `min_support_score` is compared with (`evidence_support`) in the model
fingerprint, so that a threshold calibrated, or an answer cached, on another is not used."""


def evidence_support(s_sup: float, similarity: float | None) -> float:
    """s_sup times the retriever's similarity of the branch's passage to the query (clamped
    to [0, 1]; s_sup alone when the retriever gives none): the number the support threshold
    (`min_support_score`) is compared with. A passage far from the question lowers it as a
    supported-sounding draft cannot (notes/evaluation.md)."""
    if similarity is None or math.isnan(similarity):
        return s_sup
    return s_sup * min(max(similarity, 0.0), 1.0)


def utility_score(probs: Mapping[str, float]) -> float:
    """s_use = Σ w_i·p(i) / Σ p(i) over ratings 1..5, w = (−1, −0.5, 0, 0.5, 1); 0 without mass."""
    masses = [_p(probs, str(rating)) for rating in range(1, 6)]
    total = sum(masses)
    if total <= 0.0:
        return 0.0
    return sum(w * m for w, m in zip(UTILITY_WEIGHTS, masses, strict=True)) / total


def most_likely(probs: Mapping[str, float], labels: tuple[str, ...]) -> str:
    """The label with the highest probability (ties go to the earlier label)."""
    return max(labels, key=lambda label: (_p(probs, label), -labels.index(label)))


def support_rank(label: str) -> int:
    """none < partial < full, for comparing against a `min_support` filter."""
    return {"none": 0, "partial": 1, "full": 2}[label]


@dataclass(frozen=True)
class CritiqueWeights:
    w_rel: float = 1.0
    w_sup: float = 1.0
    w_use: float = 0.5


def segment_score(
    logprob: float,
    *,
    s_rel: float | None,
    s_sup: float | None,
    s_use: float | None,
    weights: CritiqueWeights,
    n_tokens: int = 1,
    length_normalize: bool = False,
) -> float:
    """S = log p(y_t | x, d) + w_rel·s_rel + w_sup·s_sup + w_use·s_use.

    A critique that was not computed (None, e.g. s_rel of the no-retrieval branch) adds
    nothing. With `length_normalize` the log-probability is the mean per token.
    """
    base = logprob / max(n_tokens, 1) if length_normalize else logprob
    total = base
    for weight, value in (
        (weights.w_rel, s_rel),
        (weights.w_sup, s_sup),
        (weights.w_use, s_use),
    ):
        if value is not None:
            total += weight * value
    return total
