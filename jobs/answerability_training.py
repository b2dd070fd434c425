"""`selfrag train --answerability`: fit the answerability combiner (`pipeline.answerability_model`)
of
a model file and critique source on labelled SQuAD questions (tune on "Normans" only).

Per question, as the decoder's first step does: retrieve the top-K passages, draft a segment
from each with the critique source, and read the combiner's features through the product's
own readers (`pipeline.critics.read_relevance`, `read_support`). A branch is positive when
its question is answerable AND its passage contains a gold answer
(`pipeline.evaluation.qa_metrics.contains_answer`). The features, with every candidate block's
output at the
relevance and the support prompt, are kept in a cache file (NumPy .npz), so refits need no
model.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from selfrag.jobs.evaluation.eval_questions import EvalQuestion
from selfrag.pipeline.answerability_model import (
    FEATURES,
    AnswerabilityModel,
    FeatureTable,
    fit_answerability,
    probe_name,
)
from selfrag.pipeline.critics import (
    Branch,
    read_relevance,
    read_support,
    source_critic,
)
from selfrag.pipeline.critics.answerability import SupportReading
from selfrag.pipeline.evaluation.qa_metrics import contains_answer

if TYPE_CHECKING:
    from selfrag.runtime.system import LocalRuntime

# Candidate layers as shares of the model's depth (counted from 1, as the probing literature
# does): for SmolLM2's 30 layers these are 6, 9, 12, 15, 19, 22 and 26; plus the last.
LAYER_SHARES = (0.2, 0.3, 0.4, 0.5, 0.63, 0.73, 0.87)
QUESTIONS_PER_CALL = 4
# The probes' L2 strength (standardised block outputs; 30 and 300 measured alike on Normans).
SHIPPED_PROBE_L2 = 30.0


class AnswerabilityFitError(ValueError):
    """Unusable input for fitting an answerability model."""


def candidate_blocks(n_layers: int) -> list[int]:
    """The blocks (counted from 0) whose output is collected: `LAYER_SHARES` and the last."""
    layers = {max(1, min(n_layers - 1, round(n_layers * s))) for s in LAYER_SHARES}
    return sorted({layer - 1 for layer in layers} | {n_layers - 1})


def default_features(n_layers: int) -> tuple[str, ...]:
    """The features the shipped models combine: s_rel and a probe of the middle layer at the
    relevance prompt (layer 15 of SmolLM2's 30), the best per question of the combinations
    tried on Normans (notes/evaluation.md)."""
    return ("s_rel", probe_name(round(n_layers * 0.5) - 1, "relevance"))


@dataclass
class _Columns:
    """The feature table's columns, filled one grounded branch at a time."""

    values: dict[str, list[float]]
    states: dict[str, list[tuple[float, ...]]]
    labels: list[int] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    answerable: list[int] = field(default_factory=list)

    @classmethod
    def for_blocks(cls, blocks: Sequence[int]) -> _Columns:
        return cls(
            {f: [] for f in FEATURES},
            {probe_name(b, site): [] for b in blocks for site in ("support", "relevance")},
        )

    def add(self, q: EvalQuestion, b: Branch, r: SupportReading) -> None:
        """One branch: positive when its question is answerable and its passage holds a gold
        answer."""
        assert b.passage is not None
        for f in FEATURES:
            self.values[f].append(r.values[f])
        for name, column in self.states.items():
            column.append(r.states[name])
        self.labels.append(int(q.answerable and contains_answer(b.passage.text, q.golds)))
        self.groups.append(q.id)
        self.answerable.append(int(q.answerable))

    def table(self) -> FeatureTable:
        return FeatureTable(
            {f: np.asarray(v) for f, v in self.values.items()},
            {k: np.asarray(v, dtype=np.float32) for k, v in self.states.items()},
            np.asarray(self.labels, dtype=np.float64),
            self.groups,
        )


def collect_table(
    rag: LocalRuntime,
    questions: Sequence[EvalQuestion],
    source: str,
    *,
    top_k: int = 3,
    max_tokens: int = 48,
    blocks: Sequence[int] | None = None,
    progress: bool = True,
) -> tuple[FeatureTable, dict[str, Any]]:
    """The features of every labelled branch, and a description of how they were collected."""
    engine = rag.engine
    n_layers = engine.n_layers
    if n_layers is None:
        raise AnswerabilityFitError("this engine cannot return middle layers: use llama.cpp")
    blocks = list(blocks) if blocks is not None else candidate_blocks(n_layers)
    heads = rag.model.heads if source in ("auto", "learned") else None
    inner = source_critic(engine, source, rag.settings.calibration, heads)
    labelled = [q for q in questions if q.context is not None]
    if not labelled:
        raise AnswerabilityFitError("no SQuAD questions with a gold paragraph to label")
    columns = _Columns.for_blocks(blocks)
    started = time.monotonic()
    bar = tqdm(total=len(labelled), desc="answerability", file=sys.stderr, disable=not progress)
    for start in range(0, len(labelled), QUESTIONS_PER_CALL):
        chunk = labelled[start : start + QUESTIONS_PER_CALL]
        branches = [
            Branch(q.question, "", p) for q in chunk for p in rag.store.search(q.question, top_k)
        ]
        rel = read_relevance(inner, engine, branches, blocks)
        drafts = inner.draft(branches, max_tokens)
        readings = read_support(inner, engine, branches, drafts, blocks, rel, blocks)
        by_question = {q.question: q for q in chunk}
        for b, r in zip(branches, readings, strict=True):
            if r.grounded:
                columns.add(by_question[b.question], b, r)
        bar.update(len(chunk))
    bar.close()
    table = columns.table()
    labels, answerable = columns.labels, columns.answerable
    meta = {
        "source": inner.name,
        "n_layers": n_layers,
        "blocks": blocks,
        "top_k": top_k,
        "max_tokens": max_tokens,
        "questions": len(labelled),
        "branches": len(labels),
        "positives": int(sum(labels)),
        "answerable": answerable,
        "seconds": round(time.monotonic() - started, 1),
    }
    return table, meta


def save_table(path: Path, table: FeatureTable, meta: dict[str, Any]) -> None:
    """Write collected features (and how they were collected) as one .npz file."""
    arrays: dict[str, Any] = {f"value_{k}": v for k, v in table.values.items()}
    arrays.update({"state_" + k.replace(":", "@"): v for k, v in table.states.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        np.savez_compressed(
            fh,
            labels=table.labels,
            groups=np.asarray(table.groups),
            meta=np.asarray(json.dumps(meta)),
            **arrays,
        )


def load_table(path: Path) -> tuple[FeatureTable, dict[str, Any]]:
    """The features and description `save_table` wrote."""
    with np.load(path) as z:
        values = {k[6:]: z[k] for k in z.files if k.startswith("value_")}
        states = {_state_name(k[6:]): z[k] for k in z.files if k.startswith("state_")}
        table = FeatureTable(values, states, z["labels"], [str(g) for g in z["groups"]])
        meta = json.loads(str(z["meta"]))
    return table, meta


def _state_name(key: str) -> str:
    # Tables written before the relevance-prompt probes keyed support blocks by number.
    return probe_name(int(key)) if key.isdigit() else key.replace("@", ":")


def fit_model(
    table: FeatureTable,
    meta: dict[str, Any],
    model_sha256: str,
    features: Sequence[str] | None = None,
    *,
    data: dict[str, Any] | None = None,
) -> AnswerabilityModel:
    """Fit the combiner over `features` (default: `default_features`) on a collected table."""
    features = tuple(features or default_features(int(meta["n_layers"])))
    if len(set(table.labels.tolist())) < 2:
        raise AnswerabilityFitError(
            f"{len(table.labels)} branches with one label only: pass answerable and "
            "unanswerable questions whose retrieved passages hold the answer, and more of them"
        )
    manifest = {
        **{k: v for k, v in meta.items() if k != "answerable"},
        "data": data or {},
        "not_exportable": "middle-layer and draft features are no rows of the output matrix",
    }
    return fit_answerability(
        table,
        features,
        model_sha256=model_sha256,
        source=str(meta["source"]),
        probe_l2=SHIPPED_PROBE_L2,
        manifest=manifest,
    )


def describe(model: AnswerabilityModel, path: Path) -> str:
    lines = [
        f"answerability model for critique {model.source!r} "
        f"({model.manifest.get('branches')} branches, {model.manifest.get('positives')} "
        f"positive, {model.manifest.get('questions')} questions) -> {path}"
    ]
    for name, w in zip(model.features, model.combiner.weights, strict=True):
        lines.append(f"  {name:<10} weight {w:+.3f}")
    return "\n".join(lines)
