"""`selfrag eval`'s report: every record of the requested systems and questions (the latest
of each) summarised per system, with each system's abstention score and accuracy–coverage
curve, and each two systems compared question by question; written as report.json and
report.md and printed as a narrow table."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from selfrag.infra.corpus.bounded_reads import JSONInputError, load_json
from selfrag.jobs.evaluation.abstention import (
    curve_rows,
    render_abstention_table,
    score_name,
    write_curves,
)
from selfrag.jobs.evaluation.eval_questions import EvalQuestion
from selfrag.pipeline.evaluation.qa_metrics import (
    Outcome,
    PairedCounts,
    accuracy_coverage,
    paired_counts,
    summarize,
)
from selfrag.schemas.decoding import DecodingConfig

RECORDS_FILE = "records.jsonl"
REPORT_COLUMNS = (
    "accuracy",
    "f1",
    "abstain_rate",
    "wrong_confident_rate",
    "overall",
    "retrieval_rate",
    "citation_precision",
    "s_sup_correct",
    "s_sup_wrong",
    "s_sup_auc",
    "pruned_rate",
    "p50_ms",
    "p95_ms",
    "prefill_tokens",
)


def outcome(record: dict[str, Any]) -> Outcome:
    return Outcome(
        answerable=bool(record["answerable"]),
        golds=tuple(record["golds"]),
        answer=str(record["answer"]),
        abstained=bool(record["abstained"]),
        retrieved=bool(record["retrieved"]),
        s_sup=record.get("s_sup"),
        cited_has_answer=tuple(record.get("cited_has_answer", [])),
        latency_ms=float(record["latency_ms"]),
        prefill_tokens=int(record["prefill_tokens"]),
        evidence_branches=int(record.get("evidence_branches", 0)),
        branches_pruned=int(record.get("branches_pruned", 0)),
        abstention_score=record.get("abstention_score"),
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of an earlier (maybe interrupted) run; a torn last line is ignored."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(load_json(line))
        except JSONInputError:
            continue
    return records


def build_report(
    records: Sequence[dict[str, Any]],
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    config: DecodingConfig | None = None,
) -> dict[str, Any]:
    """Summaries per system over the records of the given questions (latest record wins), with
    each system's abstention score and accuracy–coverage curve (`jobs.evaluation.abstention`),
    and every two systems compared on the questions both answered (`paired`)."""
    ids = {q.id for q in questions}
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r["id"] in ids and r["system"] in systems:
            latest[(r["system"], r["id"])] = r
    judged = {key: outcome(r) for key, r in latest.items()}
    report: dict[str, Any] = {"systems": {}, "abstention_score": {}, "accuracy_coverage": {}}
    for system in systems:
        outcomes = [judged[(system, q.id)] for q in questions if (system, q.id) in judged]
        report["systems"][system] = summarize(outcomes)
        report["abstention_score"][system] = score_name(system)
        report["accuracy_coverage"][system] = curve_rows(accuracy_coverage(outcomes))
    report["paired"] = paired(judged, questions, systems)
    report["questions"] = len(questions)
    if config is not None:
        report["config"] = config.model_dump(mode="json")
    return report


PAIRED_SPLITS = (("answerable", True), ("unanswerable", False))
"""The question kinds systems are compared on, apart: right answers to answerable questions,
abstentions on unanswerable ones (`Outcome.correct`)."""


def paired(
    judged: Mapping[tuple[str, str], Outcome],
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
) -> list[dict[str, Any]]:
    """Each two `systems` (in their order) on the questions `judged` (by system and question
    id) for both, per kind of question (`PAIRED_SPLITS`): how many both, only the first, only
    the second and neither got right, and the exact McNemar p-value of that split
    (`qa_metrics.PairedCounts`)."""
    rows = []
    for first, second in itertools.combinations(systems, 2):
        row: dict[str, Any] = {"first": first, "second": second}
        for split, answerable in PAIRED_SPLITS:
            pairs = [
                (judged[(first, q.id)], judged[(second, q.id)])
                for q in questions
                if q.answerable == answerable
                and (first, q.id) in judged
                and (second, q.id) in judged
            ]
            if pairs:
                counts = paired_counts(pairs)
                row[split] = {
                    "questions": counts.questions,
                    **asdict(counts),
                    "p_value": counts.p_value,
                }
        rows.append(row)
    return rows


def write_report(
    out: Path,
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    config: DecodingConfig | None = None,
) -> dict[str, Any]:
    report = build_report(read_records(out / RECORDS_FILE), questions, systems, config)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(render_table(report) + "\n", encoding="utf-8")
    write_curves(out, report)
    return report


def render_table(report: dict[str, Any]) -> str:
    """The report as Markdown: one table of every column (rates in %, latency in ms), the
    abstention table (`jobs.evaluation.abstention.render_abstention_table`), then the paired
    comparison (`render_paired`) when there are two systems or more."""
    lines = markdown_head(["system", "n", *REPORT_COLUMNS])
    for name, row in report["systems"].items():
        cells = [name, str(row["questions"])]
        for col in REPORT_COLUMNS:
            cells.append(_cell(col, row.get(col)))
        lines.append(markdown_row(cells))
    table = "\n".join(lines) + "\n\n" + render_abstention_table(report)
    comparison = render_paired(report)
    return table + ("\n\n" + comparison if comparison else "")


def markdown_row(cells: Sequence[str]) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(cells) + " |"


def markdown_head(head: Sequence[str]) -> list[str]:
    """A Markdown table's heading row and the rule under it."""
    return [markdown_row(head), "|" + "---|" * len(head)]


PAIRED_COUNTS = tuple(f.name for f in fields(PairedCounts))
PAIRED_HEADINGS = {"answerable": "answerable (right)", "unanswerable": "unanswerable (abstained)"}


def render_paired(report: dict[str, Any]) -> str:
    """The report's `paired` rows as a Markdown table; "" without any (one system, or a report
    written before this field)."""
    head = ["first", "second", "questions", "n", "both", "only first", "only second"]
    lines = markdown_head([*head, "neither", "McNemar p"])
    for row in report.get("paired", []):
        for split, _ in PAIRED_SPLITS:
            c = row.get(split)
            if c is not None:
                cells = [row["first"], row["second"], PAIRED_HEADINGS[split]]
                cells += [str(c[k]) for k in ("questions", *PAIRED_COUNTS)]
                cells.append(f"{c['p_value']:.3f}")
                lines.append(markdown_row(cells))
    return "\n".join(lines) if len(lines) > 2 else ""


SUMMARY_COLUMNS = (
    ("accuracy", "accuracy"),
    ("abstain_rate", "abstain"),
    ("wrong_confident_rate", "wrong+sure"),
    ("retrieval_rate", "retrieval"),
    ("p50_ms", "p50 ms"),
)
"""The columns `selfrag eval` prints (report field, heading); report.md has all of them."""


def render_summary(report: dict[str, Any]) -> str:
    """The report's headline columns as a plain-text table narrower than 80 columns, then, with
    two systems or more, which of each two got the answerable questions right (`paired`)."""
    width = max([len("system"), *(len(name) for name in report["systems"])])
    head = f"{'system':<{width}} {'n':>5}" + "".join(f" {h:>10}" for _, h in SUMMARY_COLUMNS)
    lines = [head]
    for name, row in report["systems"].items():
        cells = "".join(f" {_cell(col, row.get(col)):>10}" for col, _ in SUMMARY_COLUMNS)
        lines.append(f"{name:<{width}} {row['questions']:>5}{cells}")
    pairs = [
        (f"{r['first']} / {r['second']}", r["answerable"])
        for r in report.get("paired", [])
        if "answerable" in r
    ]
    if pairs:
        title = "right on answerable: first / second"
        width = max(len(title), *(len(n) for n, _ in pairs))
        lines.append("")
        lines.append(
            f"{title:<{width}} {'both':>5} {'only 1st':>9} {'only 2nd':>9} {'McNemar p':>10}"
        )
        for name, c in pairs:
            lines.append(
                f"{name:<{width}} {c['both']:>5} {c['only_first']:>9} {c['only_second']:>9} "
                f"{c['p_value']:>10.3f}"
            )
    return "\n".join(lines)


def _cell(column: str, value: float | int | None) -> str:
    if value is None:
        return "–"
    if column.endswith("_ms") or column == "prefill_tokens":
        return f"{value:.0f}"
    if column.startswith("s_sup"):
        return f"{value:.2f}"
    return f"{100 * value:.1f}%"
