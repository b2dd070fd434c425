"""Logistic calibration of the likelihood critique: raw log-probability signals → probabilities.

Each signal x gets p = sigmoid(a·x + b). `selfrag calibrate` fits (a, b) per signal on a labelled
dev set and writes them to `$SELFRAG_HOME/calibration.toml`; the defaults below are the values it
fitted for the embedded SmolLM2-135M-Instruct on the "Normans" questions (notes/evaluation.md).
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class LogisticParams(BaseModel):
    """p = sigmoid(a·x + b)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    a: float = Field(1.0, ge=-1000.0, le=1000.0, description="Slope.")
    b: float = Field(0.0, ge=-1000.0, le=1000.0, description="Intercept.")

    def probability(self, x: float) -> float:
        """sigmoid(a·x + b), numerically safe for large |a·x + b|; 0.5 for a NaN signal."""
        z = self.a * x + self.b
        if math.isnan(z):
            return 0.5
        if z >= 0:
            return 1.0 / (1.0 + math.exp(-z))
        e = math.exp(z)
        return e / (1.0 + e)


class CalibrationSettings(BaseModel):
    """Parameters of the four likelihood signals (see `pipeline.critics.likelihood`).

    - relevance: x = mean per-token query-likelihood gain log p(q | d) − log p(q);
    - support: x = mean per-token segment-likelihood gain log p(y | x, d) − log p(y | x);
    - retrieval: x = mean token log-probability of the closed-book first segment
      (low confidence should mean retrieve; for SmolLM2 the closed-book answer was almost never
      right on the dev questions, so the fit is ≈ "always retrieve" and its slope is noise);
    - utility: x = mean token log-probability of the drafted segment (p = "the draft is right").
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Fitted by `selfrag calibrate --article Normans --limit 40 --top-k 3
    # --max-segment-tokens 32` for SmolLM2-135M-Instruct (notes/evaluation.md has how well
    # each separates).
    relevance: LogisticParams = Field(default_factory=lambda: LogisticParams(a=0.983, b=-2.115))
    support: LogisticParams = Field(default_factory=lambda: LogisticParams(a=-0.126, b=-2.336))
    retrieval: LogisticParams = Field(default_factory=lambda: LogisticParams(a=1.219, b=4.670))
    utility: LogisticParams = Field(default_factory=lambda: LogisticParams(a=0.558, b=-1.979))
    fitted_on: str | None = Field(
        "embedded default: SmolLM2-135M-Instruct, SQuAD 'Normans', 40 questions",
        description="What the parameters were fitted on (written by `selfrag calibrate`).",
    )


class SupportCalibration(BaseModel):
    """A `min_support_score` fitted on the served corpus without labels (`selfrag calibrate`,
    and the end of `selfrag index`), for one model file and critique source.

    The critique's s_sup is read on synthetic pairs drawn from the index
    (`pipeline.learning.synthetic_qa`): a question made from a passage's sentence, with its own
    passage
    (answerable); with the retriever's best other passage lacking the answer, and perturbed on
    its own passage (a name or number swapped, negated, an antonym: unanswerable).
    The threshold is the highest one that abstains on at most `max_answerable_abstain` of the
    answerable pairs. Kept per index collection: the default one's in
    `$SELFRAG_HOME/calibration/<model sha256>/<critique>.json`, another's in
    `.../<model sha256>/collections/<collection>/<critique>.json`.
    """

    # Every number finite: a NaN or infinite threshold passed every check it met later.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    format: int = 1
    model_sha256: str = Field(description="SHA-256 of the model file it was fitted with.")
    model_file: str
    critique: str = Field(description="The critique source s_sup was read from.")
    index_collection: str | None = Field(
        None,
        description="The index collection it was fitted on (`retrieval.collection`); None in a "
        "file written before calibrations were kept per collection (the default one's).",
    )
    fingerprint: str = Field(
        description="The model's identity in query-cache keys when fitted (model file, heads, "
        "answerability model): a calibration of other heads is not used."
    )
    min_support_score: float = Field(ge=0.0, le=1.0)
    max_answerable_abstain: float = Field(ge=0.0, lt=1.0)
    answerable_abstain: Fraction = Field(description="Synthetic answerable pairs below it.")
    unanswerable_abstain: Fraction | None = Field(
        description="Synthetic unanswerable pairs below it (None: none read, as by default; "
        "`selfrag calibrate --report` reads them)."
    )
    auroc: Fraction | None = Field(
        description="s_sup's AUROC, answerable vs unanswerable pairs (None: none read)."
    )
    auroc_by_trap: dict[str, Fraction | None] = Field(
        default_factory=dict,
        description="s_sup's AUROC, answerable pairs against each kind of unanswerable one "
        "(`pipeline.learning.synthetic_qa.SyntheticPair.trap`).",
    )
    questions: int
    answerable: dict[str, float | int] = Field(description="Summary of their s_sup.")
    unanswerable: dict[str, float | int] = Field(description="Summary of their s_sup.")
    pruned: dict[str, int] = Field(
        description="Pairs the source's default relevance filter (min_relevance) would prune "
        "before drafting, per kind."
    )
    collections: dict[str, dict[str, Fraction | None]] = Field(
        default_factory=dict,
        description="Per collection (corpus file) with enough pairs: its own threshold, which "
        "its passages are held to, and what it abstains on; `min_support_score`, the lowest of "
        "them, holds passages of other collections.",
    )
    threshold_collection: str | None = Field(
        None,
        description="The collection whose threshold is `min_support_score` (None: all pairs "
        "as one).",
    )
    style: str = Field(description="How the questions were written (wh or cloze).")
    seed: int
    index_version: str
    passages: int = Field(description="Passages in the index when fitted.")
    corpus_passages: dict[str, int] = Field(
        default_factory=dict,
        description="Passages of each collection (corpus file) when fitted: what indexing "
        "compares its changes with to decide whether to fit again (empty in a file written "
        "before: any change fits again).",
    )
    seconds: float
    created: str = Field(description="When, UTC, ISO 8601.")

    def corpus_thresholds(self) -> dict[str, float]:
        """Each collection's own threshold (`collections`), by collection name."""
        return {
            name: float(own)
            for name, c in self.collections.items()
            if (own := c.get("threshold")) is not None
        }
