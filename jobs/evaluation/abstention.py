"""Abstention as a decision with a curve: the score each evaluated system abstains by, and the
accuracy–coverage outputs of `selfrag eval` (points as CSV, a PNG, a Markdown table).

Every system gets one number per question, higher meaning "answer" (`abstention_score`):

- Self-RAG (`selfrag-*`): `AnswerResponse.support` less `AnswerResponse.support_threshold`,
  the margin of the best s_sup times passage similarity (`pipeline.scoring.evidence_support`)
  among the first step's grounded branches that pass every other hard filter over the support
  threshold its passage is held to. With that filter on (the learned critique's default) an
  answer whose first step retrieved abstains iff its score is below 0: the curve is the
  decision's own, also when the collections of a corpus have thresholds of their own.
- closed-book and vanilla RAG: the answer's mean token log-probability, a confidence of the
  same kind. They abstain by replying "I don't know"; such a reply has no score.

A question without a score ranks below every score (`pipeline.evaluation.qa_metrics`).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from selfrag.pipeline.evaluation.qa_metrics import CoveragePoint
from selfrag.schemas.answer import AnswerResponse

CURVE_CSV = "accuracy_coverage.csv"
CURVE_PNG = "accuracy_coverage.png"
SELFRAG_SCORE = (
    "support margin (best first-step s_sup x passage similarity, less the support threshold "
    "its passage is held to)"
)
BASELINE_SCORE = "mean token log-prob of the answer"


def score_name(system: str) -> str:
    """What `abstention_score` is for `system` (written into the report)."""
    return SELFRAG_SCORE if system.startswith("selfrag-") else BASELINE_SCORE


def abstention_score(system: str, response: AnswerResponse) -> float | None:
    """The number `system`'s abstention decision is judged by (module docstring)."""
    if system.startswith("selfrag-"):
        if response.support is None:
            return None
        return response.support - (response.support_threshold or 0.0)
    if response.abstained or not response.segments or response.segments[0].n_tokens <= 0:
        return None
    segment = response.segments[0]
    score = segment.logprob / segment.n_tokens
    return score if math.isfinite(score) else None  # JSON has no -inf


def curve_rows(points: Sequence[CoveragePoint]) -> list[dict[str, float | None]]:
    """The points as report.json holds them."""
    return [asdict(p) for p in points]


def render_abstention_table(report: Mapping[str, Any]) -> str:
    """Coverage, selective accuracy, abstention on unanswerable questions and the score's AUROC
    per system, as a Markdown table (rates in %)."""
    head = "| system | abstention score | coverage | selective_accuracy | abstain_rate | auroc |"
    lines = [head, "|---|---|---|---|---|---|"]
    names = report.get("abstention_score", {})
    for name, row in report["systems"].items():
        auroc = row.get("abstention_auroc")
        cells = [
            name,
            names.get(name, score_name(name)),
            _pct(row.get("coverage")),
            _pct(row.get("selective_accuracy")),
            _pct(row.get("abstain_rate")),
            f"{auroc:.3f}" if auroc is not None else f"– ({row.get('abstention_auroc_reason')})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def write_curves(out: Path, report: Mapping[str, Any]) -> list[Path]:
    """accuracy_coverage.csv (every system's points) and accuracy_coverage.png."""
    curves: Mapping[str, list[dict[str, float | None]]] = report.get("accuracy_coverage", {})
    csv_path = out / CURVE_CSV
    fields = ["system", "threshold", "coverage", "selective_accuracy", "unanswerable_abstain_rate"]
    with csv_path.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for system, points in curves.items():
            for p in points:
                writer.writerow({"system": system, **{k: _csv(p[k]) for k in fields[1:]}})
    return [csv_path, _plot(out / CURVE_PNG, report, curves)]


def _csv(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def _plot(
    path: Path, report: Mapping[str, Any], curves: Mapping[str, list[dict[str, float | None]]]
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.2))
    for system, points in curves.items():
        xy = [
            (p["coverage"], p["selective_accuracy"])
            for p in points
            if p["coverage"] is not None and p["selective_accuracy"] is not None
        ]
        if not xy:
            continue
        auroc = report["systems"][system].get("abstention_auroc")
        label = f"{system} (AUROC {auroc:.2f})" if auroc is not None else f"{system} (AUROC –)"
        (line,) = ax.plot([x for x, _ in xy], [y for _, y in xy], marker=".", label=label)
        # The system's own decision is the curve's last point.
        ax.plot(*xy[-1], marker="*", markersize=13, color=line.get_color(), linestyle="none")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("coverage (answerable questions answered)")
    ax.set_ylabel("selective accuracy (right, of those answered)")
    ax.set_title("Accuracy vs coverage; ★ = each system's own decision")
    if ax.get_legend_handles_labels()[0]:  # below the axes: the curves use the whole square
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
