"""Answerability: a small logistic combiner that turns named features of a drafted, grounded
segment into p("this passage answers this question"), used as s_sup for abstention.

Features (`FEATURES`), all read per branch:

* `s_sup`, `s_rel`: the critique source's own support and relevance scores;
* `copy`: share of the draft's content words found in the passage (an answer read off the
  passage copies from it);
* `echo`: share of the draft's content words found in the question (an answer that only
  repeats the question is no answer);
* `qcover`: share of the question's content words found in the passage (a question about
  something the passage never names cannot be answered from it);
* `length`: log(1 + draft tokens);
* `gain`: mean per-token log-probability of the draft with the passage minus without it;
* `probe:<block>`: a linear probe (logit) of the output of a transformer block at the
  support prompt's last token (after the draft), where the probing literature finds what a
  model "knows" in middle layers;
* `rprobe:<block>`: the same at the relevance prompt's last token ("does the passage contain
  the information needed to answer the question?", before any draft).

The combiner is p = sigmoid(w·z + b) over standardised features z, L2-regularised, fitted on
labelled questions of one model file and critique source (`jobs.answerability_training`). It is NOT
exportable to a native GGUF: middle-layer states and draft statistics are no rows of the
output matrix, so `selfrag train --export-gguf` exports the reflection heads alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from selfrag.pipeline.learning.logistic_fit import sigmoid

ANSWERABILITY_FORMAT = 1
FEATURES = ("s_sup", "s_rel", "copy", "echo", "qcover", "length", "gain")
# Probe features by the prompt they read: the support prompt, or the relevance prompt.
PROBE_SITES = {"probe:": "support", "rprobe:": "relevance"}
# Function words carry no content: an answer's copy and echo shares count the rest.
STOP_WORDS = frozenset(
    """a an the of in on at to for from by with and or but not no is are was were be been
    being it its this that these those as which who whom whose what when where why how do does
    did has have had he she they them his her their there than then so such can could would
    should will may might must also into about over under after before during i you we our
    your my me us one""".split()
)
_WORD = re.compile(r"\w+", re.UNICODE)

FloatArray = npt.NDArray[np.float64]
# The largest weight or bias a loaded model may have: a fitted, L2-regularised logistic model on
# standardised features stays far inside it, and a term this large alone settles the sigmoid.
MAX_COEFFICIENT = 100.0
# `fit_linear` replaces a scale below this by 1 (a constant column).
MIN_SCALE = 1e-9


class AnswerabilityError(ValueError):
    """An answerability model that does not fit the model file or source, or is malformed."""


def content_words(text: str) -> list[str]:
    """Lower-cased words of `text` that are not function words."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOP_WORDS]


def overlap(words: Sequence[str], text: str) -> float:
    """Share of `words` that occur as words of `text` (0 without words)."""
    if not words:
        return 0.0
    vocab = set(_WORD.findall(text.lower()))
    return sum(1 for w in words if w in vocab) / len(words)


def draft_features(draft: str, n_tokens: int, passage: str, question: str) -> dict[str, float]:
    """The grounding features read from the texts alone: copy, echo, qcover and length."""
    words = content_words(draft)
    return {
        "copy": overlap(words, passage),
        "echo": overlap(words, question),
        "qcover": overlap(content_words(question), passage),
        "length": math.log1p(n_tokens),
    }


def probe_name(block: int, site: str = "support") -> str:
    """The feature that probes `block` at the `site` prompt ("support" or "relevance")."""
    prefix = next(p for p, s in PROBE_SITES.items() if s == site)
    return f"{prefix}{block}"


def probe_site(name: str) -> tuple[str, int] | None:
    """(site, block) of a probe feature, else None."""
    for prefix, site in PROBE_SITES.items():
        if name.startswith(prefix):
            return site, int(name[len(prefix) :])
    return None


@dataclass(frozen=True)
class Linear:
    """sigmoid(w·(x − mean)/scale + b): a standardised logistic model."""

    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float

    def __post_init__(self) -> None:
        if not len(self.mean) == len(self.scale) == len(self.weights):
            raise AnswerabilityError("a linear model's mean, scale and weights differ in length")

    def logit(self, x: Sequence[float]) -> float:
        if len(x) != len(self.weights):
            raise AnswerabilityError(f"{len(x)} inputs for a model of {len(self.weights)}")
        z = (np.asarray(x, dtype=np.float64) - self.mean) / np.asarray(self.scale)
        return float(z @ np.asarray(self.weights) + self.bias)

    def to_json(self) -> dict[str, Any]:
        return {
            "mean": list(self.mean),
            "scale": list(self.scale),
            "weights": list(self.weights),
            "bias": self.bias,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], name: str = "the combiner") -> Linear:
        """The model a `to_json` document describes, refused (`AnswerabilityError`, saying
        which: `name`) unless it is one a fit can produce: finite values, positive scales
        no smaller than the fit leaves them, and weights and bias within `MAX_COEFFICIENT`."""
        model = cls(
            tuple(float(v) for v in doc["mean"]),
            tuple(float(v) for v in doc["scale"]),
            tuple(float(v) for v in doc["weights"]),
            float(doc["bias"]),
        )
        values = (*model.mean, *model.scale, *model.weights, model.bias)
        if not all(math.isfinite(v) for v in values):
            raise AnswerabilityError(f"{name} has values that are not finite (inf or NaN)")
        if any(v < MIN_SCALE for v in model.scale):
            raise AnswerabilityError(
                f"{name} has a scale below {MIN_SCALE:g} (zero or negative scales divide by "
                "nothing or flip a feature)"
            )
        if any(abs(v) > MAX_COEFFICIENT for v in (*model.weights, model.bias)):
            raise AnswerabilityError(
                f"{name} has a weight or bias beyond ±{MAX_COEFFICIENT:g}: it would answer "
                "the same for every input"
            )
        return model


@dataclass(frozen=True)
class AnswerabilityModel:
    """The combiner of one model file (by SHA-256) and critique source: feature names in
    order, the combiner over them, and a linear probe per middle block it reads."""

    model_sha256: str
    source: str
    features: tuple[str, ...]
    combiner: Linear
    probes: Mapping[str, Linear] = field(default_factory=dict)
    manifest: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.features) != len(self.combiner.weights):
            raise AnswerabilityError(
                f"{len(self.features)} features for a combiner of {len(self.combiner.weights)}"
            )
        unknown = [f for f in self.features if f not in FEATURES and probe_site(f) is None]
        if unknown:
            raise AnswerabilityError(f"unknown features {unknown}")
        missing = [f for f in self.features if probe_site(f) is not None and f not in self.probes]
        if missing:
            raise AnswerabilityError(f"no probe for {missing}")

    def blocks_at(self, site: str) -> tuple[int, ...]:
        """The blocks whose output the features read at the `site` prompt."""
        return tuple(
            at[1] for f in self.features if (at := probe_site(f)) is not None and at[0] == site
        )

    @property
    def blocks(self) -> tuple[int, ...]:
        """Every block any feature reads, at either prompt."""
        return tuple(
            sorted({b for site in set(PROBE_SITES.values()) for b in self.blocks_at(site)})
        )

    def check(self, model_sha256: str, source: str, hidden_size: int | None = None) -> None:
        """Refuse a model fitted on another model file or critique source, or whose probes
        read block outputs of another width than the model's `hidden_size`."""
        widths = {len(p.weights) for p in self.probes.values()}
        if hidden_size is not None and widths - {hidden_size}:
            raise AnswerabilityError(
                f"probes of width {sorted(widths)} for a model of hidden size {hidden_size}"
            )
        if model_sha256 != self.model_sha256:
            raise AnswerabilityError(
                f"this answerability model was fitted for the model file sha256:"
                f"{self.model_sha256}, not for sha256:{model_sha256}"
            )
        if source != self.source:
            raise AnswerabilityError(
                f"this answerability model was fitted on critique {self.source!r}, not {source!r}"
            )

    def probability(
        self, values: Mapping[str, float], states: Mapping[str, Sequence[float]]
    ) -> float:
        """p(answerable from this passage) from the named features and the block outputs
        (`states`, by probe feature name)."""
        x = []
        for name in self.features:
            if probe_site(name) is None:
                x.append(float(values[name]))
            elif name not in states:
                raise AnswerabilityError(f"no block output for {name}")
            else:
                x.append(self.probes[name].logit(states[name]))
        return sigmoid(self.combiner.logit(x))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": ANSWERABILITY_FORMAT,
            "model_sha256": self.model_sha256,
            "source": self.source,
            "features": list(self.features),
            "combiner": self.combiner.to_json(),
            "probes": {name: p.to_json() for name, p in self.probes.items()},
            "manifest": dict(self.manifest),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> AnswerabilityModel:
        """The model a `to_json` document describes; anything malformed is an
        `AnswerabilityError`."""
        try:
            if doc.get("format") != ANSWERABILITY_FORMAT:
                raise AnswerabilityError(
                    f"format {doc.get('format')!r}, expected {ANSWERABILITY_FORMAT}"
                )
            model = cls(
                model_sha256=str(doc["model_sha256"]),
                source=str(doc["source"]),
                features=tuple(str(f) for f in doc["features"]),
                combiner=Linear.from_json(doc["combiner"]),
                probes={
                    str(k): Linear.from_json(p, f"the probe {k!r}")
                    for k, p in doc.get("probes", {}).items()
                },
                manifest=dict(doc.get("manifest", {})),
            )
            if not any(model.combiner.weights):
                raise AnswerabilityError(
                    "the combiner weighs no feature: it would answer the same for every input"
                )
            return model
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, AnswerabilityError):
                raise
            raise AnswerabilityError(f"not an answerability model ({exc!r})") from exc


# --- fitting ------------------------------------------------------------------------------------


def fit_linear(X: npt.ArrayLike, y: npt.ArrayLike, l2: float = 1.0) -> Linear:
    """L2-regularised logistic regression on standardised columns (Newton's method).

    The penalty l2/2·|w|² is on the weights (not the bias), in units of the mean log-loss
    times n, so its strength does not depend on the sample count's scale. A single class is
    an `AnswerabilityError`.
    """
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if X.ndim != 2 or len(X) != len(y) or len(X) == 0:
        raise AnswerabilityError(f"features of shape {X.shape} for {len(y)} labels")
    positives = float(y.sum())
    if positives in (0.0, float(len(y))):
        raise AnswerabilityError("the labels have one class only: nothing to separate")
    mean = X.mean(axis=0)
    scale = X.std(axis=0)
    scale[scale < MIN_SCALE] = 1.0
    Z = np.hstack([(X - mean) / scale, np.ones((len(X), 1))])
    d = Z.shape[1]
    penalty = np.full(d, l2)
    penalty[-1] = 0.0
    theta = np.zeros(d)
    theta[-1] = math.log(positives / (len(y) - positives))
    for _ in range(100):
        p = 1.0 / (1.0 + np.exp(-(Z @ theta)))
        grad = Z.T @ (p - y) + penalty * theta
        hess = (Z * (p * (1.0 - p))[:, None]).T @ Z + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if float(np.abs(step).max()) < 1e-8:
            break
    return Linear(
        tuple(mean.tolist()), tuple(scale.tolist()), tuple(theta[:-1].tolist()), float(theta[-1])
    )


def linear_logits(model: Linear, X: npt.ArrayLike) -> FloatArray:
    """`model.logit` of every row of X at once."""
    X = np.asarray(X, dtype=np.float64)
    return ((X - np.asarray(model.mean)) / np.asarray(model.scale)) @ np.asarray(
        model.weights
    ) + model.bias


def group_folds(groups: Sequence[str], k: int, seed: int = 0) -> FloatArray:
    """A fold number (0..k−1) per row, every group (question) in one fold."""
    order = sorted(set(groups))
    rng = np.random.default_rng(seed)
    rng.shuffle(order)
    fold_of = {g: i % k for i, g in enumerate(order)}
    return np.array([fold_of[g] for g in groups])


@dataclass
class FeatureTable:
    """Collected features of labelled branches: named columns, block outputs (by probe
    feature name), labels, groups (question ids)."""

    values: dict[str, FloatArray]
    states: dict[str, FloatArray]
    labels: FloatArray
    groups: list[str]

    def subset(self, rows: npt.NDArray[np.bool_]) -> FeatureTable:
        return FeatureTable(
            {k: v[rows] for k, v in self.values.items()},
            {k: v[rows] for k, v in self.states.items()},
            self.labels[rows],
            [g for g, keep in zip(self.groups, rows, strict=True) if keep],
        )


def probe_features(
    table: FeatureTable, names: Sequence[str], probe_l2: float, k: int = 5, seed: int = 0
) -> tuple[dict[str, Linear], dict[str, FloatArray]]:
    """Per probe feature: the probe fitted on all rows, and each row's probe logit from a probe
    fitted without its question's fold (so a combiner fitted on them does not trust an
    overfitted probe)."""
    folds = group_folds(table.groups, k, seed)
    probes: dict[str, Linear] = {}
    logits: dict[str, FloatArray] = {}
    for b in names:
        X = table.states[b]
        out = np.zeros(len(X))
        for f in range(k):
            test = folds == f
            if not test.any() or len(set(table.labels[~test].tolist())) < 2:
                continue
            out[test] = linear_logits(fit_linear(X[~test], table.labels[~test], probe_l2), X[test])
        probes[b] = fit_linear(X, table.labels, probe_l2)
        logits[b] = out
    return probes, logits


def fit_answerability(
    table: FeatureTable,
    features: Sequence[str],
    *,
    model_sha256: str,
    source: str,
    l2: float = 1.0,
    probe_l2: float = 300.0,
    manifest: Mapping[str, Any] | None = None,
) -> AnswerabilityModel:
    """Fit the probes of the `probe:<block>` features (cross-fitted by question) and the
    combiner over `features`."""
    names = [f for f in features if probe_site(f) is not None]
    probes, logits = probe_features(table, names, probe_l2)
    columns = [logits[f] if f in logits else table.values[f] for f in features]
    combiner = fit_linear(np.column_stack(columns), table.labels, l2)
    return AnswerabilityModel(
        model_sha256=model_sha256,
        source=source,
        features=tuple(features),
        combiner=combiner,
        probes=probes,
        manifest=dict(manifest or {}),
    )


def predict(model: AnswerabilityModel, table: FeatureTable) -> FloatArray:
    """`model.probability` of every row of `table`."""
    columns = [
        linear_logits(model.probes[f], table.states[f]) if f in model.probes else table.values[f]
        for f in model.features
    ]
    z = linear_logits(model.combiner, np.column_stack(columns))
    return 1.0 / (1.0 + np.exp(-z))
