"""`selfrag eval`'s report: every record of the requested systems and questions (the latest
of each) summarised per system, with each system's abstention score and accuracy–coverage
curve on short questions and the long-form metrics on questions that list facts, and each two
systems compared question by question (and fact by fact); written as report.json and
report.md (and the long answers judged unit by unit, longform_answers.jsonl) and printed as a
narrow table."""

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
from selfrag.jobs.evaluation.longform_report import (
    ANSWERS_FILE,
    LONGFORM_COLUMNS,
    answer_rows,
    judge_record,
    longform_pairs,
    longform_row,
    unit_marks,
    without_text,
    write_answers,
)
from selfrag.pipeline.evaluation.longform_metrics import LongformJudgment
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


ShortJudged = dict[tuple[str, str], Outcome]
LongJudged = dict[tuple[str, str], tuple[dict[str, Any], LongformJudgment]]
"""Records judged, by (system, question id): short questions' outcomes; long-form questions'
records with their judgments."""


def judge_records(
    records: Sequence[dict[str, Any]], questions: Sequence[EvalQuestion], systems: Sequence[str]
) -> tuple[ShortJudged, LongJudged]:
    """The latest record of each system and question judged once: `outcome` for a short
    question, `longform_report.judge_record` for one that lists facts (a record written
    without units is left out)."""
    by_id = {q.id: q for q in questions}
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r["id"] in by_id and r["system"] in systems:
            latest[(r["system"], r["id"])] = r
    short: ShortJudged = {}
    long: LongJudged = {}
    for key, r in latest.items():
        q = by_id[key[1]]
        if not q.facts:
            short[key] = outcome(r)
        elif (j := judge_record(r, q)) is not None:
            long[key] = (r, j)
    return short, long


def build_report(
    records: Sequence[dict[str, Any]],
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    config: DecodingConfig | None = None,
) -> dict[str, Any]:
    """`report_of` the records judged (`judge_records`)."""
    return report_of(judge_records(records, questions, systems), questions, systems, config)


def report_of(
    judged: tuple[ShortJudged, LongJudged],
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    config: DecodingConfig | None = None,
) -> dict[str, Any]:
    """Summaries per system: on short questions with each system's abstention score and
    accuracy–coverage curve (`jobs.evaluation.abstention`), on long-form ones (questions that
    list facts) under `longform` (`jobs.evaluation.longform_report`), and every two systems
    compared on the questions both answered (`paired`)."""
    short_judged, long_judged = judged
    short = [q for q in questions if not q.facts]
    long = [q for q in questions if q.facts]
    report: dict[str, Any] = {"systems": {}, "abstention_score": {}, "accuracy_coverage": {}}
    for system in systems:
        outcomes = [short_judged[(system, q.id)] for q in short if (system, q.id) in short_judged]
        report["systems"][system] = summarize(outcomes)
        report["abstention_score"][system] = score_name(system)
        report["accuracy_coverage"][system] = curve_rows(accuracy_coverage(outcomes))
    if long:
        report["longform"] = {
            system: longform_row(
                [long_judged[(system, q.id)] for q in long if (system, q.id) in long_judged]
            )
            for system in systems
        }
        rows = answer_rows(long_judged, long, systems)
        report["longform_answers"] = [without_text(row) for row in rows]
    report["paired"] = paired(
        short_judged, questions, systems, {k: j for k, (_, j) in long_judged.items()}
    )
    report["questions"] = len(questions)
    report["longform_questions"] = len(long)
    if config is not None:
        report["config"] = config.model_dump(mode="json")
    return report


PAIRED_SPLITS = (("answerable", True), ("unanswerable", False))
"""The short question kinds systems are compared on, apart: right answers to answerable
questions, abstentions on unanswerable ones (`Outcome.correct`)."""


def paired(
    judged: Mapping[tuple[str, str], Outcome],
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    long_judged: Mapping[tuple[str, str], LongformJudgment] | None = None,
) -> list[dict[str, Any]]:
    """Each two `systems` (in their order) on the questions judged (by system and question id)
    for both: per kind of short question (`PAIRED_SPLITS`, from `judged`), and on long-form
    questions (`long_judged`) per question, every fact stated, and per fact, stated
    (`longform_report.longform_pairs`): how many both, only the first, only the second and
    neither got right, and the exact McNemar p-value of that split
    (`qa_metrics.PairedCounts`)."""
    long_judged = long_judged or {}
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
                row[split] = _paired_cell(paired_counts(pairs))
        long_pairs = [
            (long_judged[(first, q.id)], long_judged[(second, q.id)])
            for q in questions
            if (first, q.id) in long_judged and (second, q.id) in long_judged
        ]
        if long_pairs:
            for name, counts in longform_pairs(long_pairs).items():
                row[name] = _paired_cell(counts, "facts" if name == "facts_stated" else "questions")
        rows.append(row)
    return rows


def _paired_cell(counts: PairedCounts, items: str = "questions") -> dict[str, Any]:
    """A paired split as report.json holds it; `items` names what was counted."""
    return {items: counts.questions, **asdict(counts), "p_value": counts.p_value}


def write_report(
    out: Path,
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    config: DecodingConfig | None = None,
) -> dict[str, Any]:
    judged = judge_records(read_records(out / RECORDS_FILE), questions, systems)
    report = report_of(judged, questions, systems, config)
    if report["longform_questions"]:
        long = [q for q in questions if q.facts]
        write_answers(out / ANSWERS_FILE, answer_rows(judged[1], long, systems))
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(render_table(report) + "\n", encoding="utf-8")
    write_curves(out, report)
    return report


def render_table(report: dict[str, Any]) -> str:
    """The report as Markdown: on short questions one table of every column (rates in %,
    latency in ms) and the abstention table (`jobs.evaluation.abstention.render_abstention_table`);
    on long-form questions their table (`render_longform`); then the paired comparison
    (`render_paired`) when there are two systems or more."""
    tables = []
    if any(row["questions"] for row in report["systems"].values()):
        lines = markdown_head(["system", "n", *REPORT_COLUMNS])
        for name, row in report["systems"].items():
            cells = [name, str(row["questions"])]
            for col in REPORT_COLUMNS:
                cells.append(_cell(col, row.get(col)))
            lines.append(markdown_row(cells))
        tables += ["\n".join(lines), render_abstention_table(report)]
    if report.get("longform"):
        tables.append(render_longform(report))
    comparison = render_paired(report)
    tables += [comparison] if comparison else []
    if report.get("longform_answers"):
        tables.append(render_longform_answers(report))
    return "\n\n".join(tables)


def render_longform(report: dict[str, Any]) -> str:
    """The long-form rows as a Markdown table (rates in %, tokens per answer, time in ms)."""
    lines = markdown_head(["system", "n", "facts", *LONGFORM_COLUMNS])
    for name, row in report["longform"].items():
        cells = [name, str(row["questions"]), str(row["facts"])]
        cells += [_cell(col, row.get(col)) for col in LONGFORM_COLUMNS]
        lines.append(markdown_row(cells))
    return "\n".join(lines)


ANSWER_COLUMNS = (
    "id",
    "system",
    "stated",
    "cited",
    "fact recall",
    "cite rec",
    "cite prec",
    "units",
    "per unit",
    "prefill",
    "decode",
    "ms",
)


def render_longform_answers(report: dict[str, Any]) -> str:
    """Every long answer in one row (`longform_report.answer_row`): the facts it states and
    cites, its own rates, its units and each one's verdict (`longform_report.unit_marks`),
    its tokens and time."""
    lines = [
        "Per answer: stated / cited facts of those listed; per unit (a Self-RAG segment, a "
        "baseline's sentence) the facts it states (· none), then + its citations hold that, "
        "- they do not, 0 it cites nothing.",
        "",
        *markdown_head(ANSWER_COLUMNS),
    ]
    for a in report["longform_answers"]:
        n = len(a["facts"])
        cells = [a["id"], a["system"], f"{len(a['stated'])}/{n}", f"{len(a['cited'])}/{n}"]
        cells += [_cell(c, a[c]) for c in ("fact_recall", "citation_recall", "citation_precision")]
        marks = "abstained" if a["abstained"] else unit_marks(a["units"]) or "–"
        cells += [str(len(a["units"])), marks]
        cells += [str(a["prefill_tokens"]), str(a["decode_tokens"]), f"{a['latency_ms']:.0f}"]
        lines.append(markdown_row(cells))
    return "\n".join(lines)


def markdown_row(cells: Sequence[str]) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(cells) + " |"


def markdown_head(head: Sequence[str]) -> list[str]:
    """A Markdown table's heading row and the rule under it."""
    return [markdown_row(head), "|" + "---|" * len(head)]


PAIRED_COUNTS = tuple(f.name for f in fields(PairedCounts))
PAIRED_HEADINGS = {
    "answerable": "answerable (right)",
    "unanswerable": "unanswerable (abstained)",
    "fully_covered": "long-form (every fact stated)",
    "facts_stated": "facts (stated)",
}
"""Each paired split's heading, in the order the tables show them."""


def render_paired(report: dict[str, Any]) -> str:
    """The report's `paired` rows as a Markdown table; "" without any (one system, or a report
    written before this field)."""
    head = ["first", "second", "compared on", "n", "both", "only first", "only second"]
    lines = markdown_head([*head, "neither", "McNemar p"])
    for row in report.get("paired", []):
        for split, heading in PAIRED_HEADINGS.items():
            c = row.get(split)
            if c is not None:
                cells = [row["first"], row["second"], heading]
                cells += [str(c.get("facts", c.get("questions")))]
                cells += [str(c[k]) for k in PAIRED_COUNTS]
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
LONGFORM_SUMMARY_COLUMNS = (
    ("fact_recall", "facts"),
    ("fully_covered", "covered"),
    ("citation_precision", "cite prec"),
    ("citation_recall", "cite rec"),
    ("p50_ms", "p50 ms"),
)
"""The long-form columns `selfrag eval` prints."""
SUMMARY_PAIRS = (
    ("answerable", "right on answerable"),
    ("facts_stated", "facts stated"),
)
"""The paired splits `selfrag eval` prints (report field, title)."""


def render_summary(report: dict[str, Any]) -> str:
    """The report's headline columns as plain-text tables narrower than 80 columns (short
    questions, long-form questions, as the set has them), then, with two systems or more,
    which of each two got the answerable questions right and stated each fact (`paired`)."""
    blocks = []
    if any(row["questions"] for row in report["systems"].values()) or not report.get("longform"):
        blocks.append(_summary_table(report["systems"], SUMMARY_COLUMNS))
    if report.get("longform"):
        blocks.append(_summary_table(report["longform"], LONGFORM_SUMMARY_COLUMNS))
    for split, title in SUMMARY_PAIRS:
        pairs = [
            (f"{r['first']} / {r['second']}", r[split])
            for r in report.get("paired", [])
            if split in r
        ]
        if not pairs:
            continue
        title = f"{title}: first / second"
        width = max(len(title), *(len(n) for n, _ in pairs))
        lines = [f"{title:<{width}} {'both':>5} {'only 1st':>9} {'only 2nd':>9} {'McNemar p':>10}"]
        for name, c in pairs:
            lines.append(
                f"{name:<{width}} {c['both']:>5} {c['only_first']:>9} {c['only_second']:>9} "
                f"{c['p_value']:>10.3f}"
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _summary_table(
    rows: Mapping[str, Mapping[str, Any]], columns: Sequence[tuple[str, str]]
) -> str:
    width = max([len("system"), *(len(name) for name in rows)])
    lines = [f"{'system':<{width}} {'n':>5}" + "".join(f" {h:>10}" for _, h in columns)]
    for name, row in rows.items():
        cells = "".join(f" {_cell(col, row.get(col)):>10}" for col, _ in columns)
        lines.append(f"{name:<{width}} {row['questions']:>5}{cells}")
    return "\n".join(lines)


# Columns that are counts or means of counts, not rates.
_WHOLE_COLUMNS = frozenset({"prefill_tokens", "decode_tokens", "filler_units"})
_MEAN_COLUMNS = frozenset({"units_per_answer", "citations_per_unit"})


def _cell(column: str, value: float | int | None) -> str:
    if value is None:
        return "–"
    if column.endswith("_ms") or column in _WHOLE_COLUMNS:
        return f"{value:.0f}"
    if column in _MEAN_COLUMNS:
        return f"{value:.2f}"
    if column.startswith("s_sup"):
        return f"{value:.2f}"
    return f"{100 * value:.1f}%"
