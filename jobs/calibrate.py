"""`selfrag calibrate`: fit the likelihood critique's logistic calibration on a labelled dev set.

Labelling, per SQuAD question (tune on the "Normans" article only):
- relevance (answerable questions): the question's own paragraph is positive; the retrieved
  passages from other documents that do not contain a gold answer are negative;
- support: the segment drafted from each of those passages is positive when both the passage
  and the segment contain a gold answer; every segment drafted for an unanswerable question is
  negative (its evidence cannot support an answer) — so s_sup learns to be low there too;
- retrieval: the closed-book first segment is positive ("retrieve") unless it already contains
  a gold answer; unanswerable questions count as positive;
- utility: every drafted segment (with or without evidence) is positive when it contains a gold
  answer of an answerable question.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from selfrag.infra.file_lock import write_atomic
from selfrag.infra.settings_loader import CALIBRATION_FILE
from selfrag.jobs.evaluation.eval_questions import EvalQuestion
from selfrag.pipeline.critics import Branch
from selfrag.pipeline.critics.likelihood import LikelihoodCritic, mean
from selfrag.pipeline.evaluation.qa_metrics import contains_answer
from selfrag.pipeline.learning.logistic_fit import auc, fit_logistic
from selfrag.pipeline.protocols import Passage
from selfrag.schemas.calibration import CalibrationSettings

if TYPE_CHECKING:
    from selfrag.runtime.system import LocalRuntime

SIGNALS = ("relevance", "support", "retrieval", "utility")


def collect_samples(
    rag: LocalRuntime,
    questions: Sequence[EvalQuestion],
    top_k: int,
    max_tokens: int,
    *,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Raw (signal, x, y) samples from the real model and index, as documented above."""
    critic = LikelihoodCritic(rag.engine, rag.settings.calibration, probe_tokens=max_tokens)
    samples: list[dict[str, Any]] = []
    for q in tqdm(questions, desc="calibrate", file=sys.stderr, disable=not progress):
        if q.context is None or q.paragraph_id is None:
            continue  # labels need the gold paragraph: SQuAD questions only
        gold = Passage(id=q.paragraph_id, text=" ".join(q.context.split()), title=_title(q.article))
        retrieved = rag.store.search(q.question, top_k)
        others = [
            p
            for p in retrieved
            if p.metadata.get("doc_id", p.id.split("#")[0]) != q.paragraph_id
            and not (q.answerable and contains_answer(p.text, q.golds))
        ]
        passages = [gold, *others]
        branches = [Branch(q.question, "", p) for p in passages]
        (closed,) = critic.closed_book_drafts([Branch(q.question, "", None)])
        closed_right = q.answerable and contains_answer(closed.text, q.golds)
        samples.append(
            _sample(
                "retrieval", q, mean(closed.logprobs) if closed.tokens else -20.0, not closed_right
            )
        )
        if closed.tokens:
            samples.append(_sample("utility", q, mean(closed.logprobs), closed_right))
        if q.answerable:
            for i, s in enumerate(critic.relevance_signals(branches)):
                samples.append(_sample("relevance", q, s.value, i == 0))
        drafts = critic.draft(branches, max_tokens)
        for p, d, s in zip(passages, drafts, critic.support_signals(branches, drafts), strict=True):
            if not d.tokens:
                continue
            right = q.answerable and contains_answer(d.text, q.golds)
            grounded = right and contains_answer(p.text, q.golds)
            samples.append(_sample("support", q, s.value, grounded))
            samples.append(_sample("utility", q, mean(d.logprobs), right))
    return samples


def _title(article: str | None) -> str | None:
    return article.replace("_", " ") if article else None


def _sample(signal: str, q: EvalQuestion, x: float, y: bool) -> dict[str, Any]:
    return {"signal": signal, "id": q.id, "x": x, "y": bool(y)}


def fit_samples(
    samples: Sequence[dict[str, Any]], fitted_on: str
) -> tuple[CalibrationSettings, dict[str, dict[str, float | int | None]]]:
    """Fit each signal's (a, b); also return per-signal diagnostics (n, positives, AUC)."""
    params: dict[str, Any] = {}
    stats: dict[str, dict[str, float | int | None]] = {}
    defaults = CalibrationSettings()
    for signal in SIGNALS:
        xs = [s["x"] for s in samples if s["signal"] == signal]
        ys = [s["y"] for s in samples if s["signal"] == signal]
        if xs:
            params[signal] = fit_logistic(xs, ys)
        else:
            params[signal] = getattr(defaults, signal)
        stats[signal] = {"n": len(xs), "positives": sum(ys), "auc": auc(xs, ys) if xs else None}
    return CalibrationSettings(**params, fitted_on=fitted_on), stats


def calibration_toml(cal: CalibrationSettings) -> str:
    """The calibration as TOML, the way `infra.settings_loader` reads `HOME/calibration.toml`."""
    lines = ["# Written by `selfrag calibrate`; p = sigmoid(a*x + b) per likelihood signal."]
    if cal.fitted_on:
        lines.append(f"fitted_on = {json.dumps(cal.fitted_on)}")
    for signal in SIGNALS:
        p = getattr(cal, signal)
        lines += ["", f"[{signal}]", f"a = {p.a!r}", f"b = {p.b!r}"]
    return "\n".join(lines) + "\n"


def write_calibration(home: Path, cal: CalibrationSettings) -> Path:
    path = home / CALIBRATION_FILE
    # Atomic: a server starting meanwhile reads the old calibration or the new one.
    write_atomic(path, calibration_toml(cal).encode(), mode=0o644)
    return path


def describe(stats: dict[str, dict[str, float | int | None]], cal: CalibrationSettings) -> str:
    lines = [f"{'signal':<10} {'n':>5} {'pos':>5} {'AUC':>6} {'a':>8} {'b':>8}"]
    for signal, st in stats.items():
        p = getattr(cal, signal)
        a_u_c = st["auc"]
        lines.append(
            f"{signal:<10} {st['n']:>5} {st['positives']:>5} "
            f"{'-' if a_u_c is None else f'{a_u_c:.3f}':>6} {p.a:>8.3f} {p.b:>8.3f}"
        )
    return "\n".join(lines)


def dataset_label(path: Path, article: str | None, n: int) -> str:
    """What the parameters were fitted on, for the `fitted_on` field."""
    return f"{path.name}" + (f" article={article}" if article else "") + f" questions={n}"
