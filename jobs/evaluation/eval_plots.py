"""`selfrag eval --plot`: accuracy against the retrieval threshold δ and the reliability of
s_sup, from an evaluation's records."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from selfrag.jobs.evaluation.eval_questions import EvalQuestion
from selfrag.jobs.evaluation.eval_report import RECORDS_FILE, outcome, read_records


def threshold_curve(
    own: Sequence[dict[str, Any]], closed: dict[str, dict[str, Any]], thresholds: Sequence[float]
) -> list[tuple[float, float]]:
    """Accuracy (answerable questions) at each δ, from one system's first-step p_ret.

    At δ a question is answered with evidence when p_ret > δ, else without. An outcome is
    known from the system's own record when it took that path, else, for the no-evidence path,
    from the closed-book record. A δ at which some needed outcome is unknown is left out, so
    the curve is exact for runs in `--mode always` with a closed-book run beside them.
    """
    points: list[tuple[float, float]] = []
    rows = [r for r in own if r["answerable"] and r.get("p_ret") is not None]
    if not rows:
        return points
    for delta in thresholds:
        correct: list[float] = []
        for r in rows:
            wants = r["p_ret"] > delta
            if wants == bool(r["retrieved"]):
                correct.append(float(outcome(r).correct))
            elif not wants and r["id"] in closed:
                correct.append(float(outcome(closed[r["id"]]).correct))
            else:
                break
        else:
            points.append((delta, sum(correct) / len(correct)))
    return points


def reliability(rows: Sequence[dict[str, Any]], bins: int = 5) -> list[tuple[float, float, int]]:
    """(mean s_sup, fraction correct, count) per s_sup bin over answered answerable questions."""
    buckets: list[list[tuple[float, bool]]] = [[] for _ in range(bins)]
    for r in rows:
        o = outcome(r)
        if r["answerable"] and not o.abstained and o.s_sup is not None:
            buckets[min(int(o.s_sup * bins), bins - 1)].append((o.s_sup, o.correct))
    return [
        (sum(s for s, _ in b) / len(b), sum(c for _, c in b) / len(b), len(b)) for b in buckets if b
    ]


def _save_figure(fig: Any, path: Path) -> Path:
    """Write `fig` as a PNG and release it (pyplot keeps every open figure otherwise)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(out: Path, questions: Sequence[EvalQuestion], systems: Sequence[str]) -> list[Path]:
    """accuracy_vs_threshold.png and support_reliability.png for the self-RAG systems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ids = {q.id for q in questions}
    records = [r for r in read_records(out / RECORDS_FILE) if r["id"] in ids]
    by_system: dict[str, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_system.setdefault(r["system"], {})[r["id"]] = r
    closed = by_system.get("closed-book", {})
    selfrag = [s for s in systems if s.startswith("selfrag-") and s in by_system]
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(6, 4))
    deltas = [i / 50 for i in range(51)]
    for s in selfrag:
        pts = threshold_curve(list(by_system[s].values()), closed, deltas)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=s)
    for s in ("closed-book", "vanilla-rag"):
        if s in by_system:
            rows = [outcome(r) for r in by_system[s].values() if r["answerable"]]
            if rows:
                acc = sum(o.correct for o in rows) / len(rows)
                ax.axhline(
                    acc,
                    linestyle="--",
                    linewidth=1,
                    label=s,
                    color="grey" if s == "closed-book" else "black",
                )
    ax.set_xlabel("retrieval threshold δ (retrieve when p_ret > δ)")
    ax.set_ylabel("accuracy (answerable questions)")
    ax.set_ylim(0, 1)
    ax.set_title("Accuracy vs retrieval threshold")
    ax.legend(fontsize=8)
    written.append(_save_figure(fig, out / "accuracy_vs_threshold.png"))

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], linestyle=":", color="grey", label="perfectly calibrated")
    for s in selfrag:
        pts = reliability(list(by_system[s].values()))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
            for x, y, n in pts:
                ax.annotate(str(n), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("mean s_sup of the answer")
    ax.set_ylabel("fraction correct (answerable questions)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title("Support score reliability")
    ax.legend(fontsize=8)
    written.append(_save_figure(fig, out / "support_reliability.png"))
    return written
