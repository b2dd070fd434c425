"""Long answers in `selfrag eval`'s report: each record of a question that lists facts judged
(`pipeline.evaluation.longform_metrics`), summarised per system with its tokens and time, two
systems compared per question (every fact stated) and per fact (stated), and every judged answer
written unit by unit to longform_answers.jsonl for reading."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from selfrag.jobs.evaluation.eval_questions import EvalQuestion
from selfrag.pipeline.evaluation.longform_metrics import (
    LongformJudgment,
    SourcePassage,
    Unit,
    judge_answer,
    summarize_longform,
)
from selfrag.pipeline.evaluation.qa_metrics import (
    PairedCounts,
    mean_or_none,
    paired_flags,
    percentile,
)

ANSWERS_FILE = "longform_answers.jsonl"
LONGFORM_COLUMNS = (
    "fact_recall",
    "fully_covered",
    "facts_retrieved",
    "citation_recall",
    "citation_precision",
    "citation_precision_facts",
    "filler_precision",
    "filler_units",
    "units_per_answer",
    "citations_per_unit",
    "abstain_rate",
    "prefill_tokens",
    "decode_tokens",
    "mean_ms",
    "p50_ms",
)
"""The long-form row's columns report.md shows, in order."""


def judge_record(record: Mapping[str, Any], question: EvalQuestion) -> LongformJudgment | None:
    """The record's answer judged against the question's facts; None for a record written
    without units (before long-form evaluation, or for a question then without facts)."""
    if record.get("units") is None:
        return None
    units = [Unit(u["text"], tuple(u["cited"])) for u in record["units"]]
    passages = {
        p["id"]: SourcePassage(p["text"], p.get("title")) for p in record.get("passages") or []
    }
    return judge_answer(
        str(record["answer"]),
        units,
        passages,
        question.facts,
        abstained=bool(record["abstained"]),
    )


def longform_row(
    judged: Sequence[tuple[Mapping[str, Any], LongformJudgment]],
) -> dict[str, float | int | None]:
    """One system's long-form row (`summarize_longform`) with the mean prefill and decode
    tokens and the mean and median time per answer, over its judged records."""
    records = [r for r, _ in judged]
    latencies = [float(r["latency_ms"]) for r in records]
    return {
        **summarize_longform([j for _, j in judged]),
        "prefill_tokens": mean_or_none([float(r["prefill_tokens"]) for r in records]),
        "decode_tokens": mean_or_none([float(r.get("decode_tokens", 0)) for r in records]),
        "mean_ms": mean_or_none(latencies),
        "p50_ms": percentile(latencies, 50),
    }


LONGFORM_PAIRS = ("fully_covered", "facts_stated")
"""The paired comparisons of long answers: per question, every fact stated; per fact, stated."""


def longform_pairs(
    pairs: Sequence[tuple[LongformJudgment, LongformJudgment]],
) -> dict[str, PairedCounts]:
    """Two systems' judgments of the same questions, compared per question (`fully_covered`)
    and per fact (`facts_stated`)."""
    return {
        "fully_covered": paired_flags((a.covered, b.covered) for a, b in pairs),
        "facts_stated": paired_flags(
            (f in a.stated, f in b.stated) for a, b in pairs for f in a.facts
        ),
    }


def answer_row(
    system: str, qid: str, record: Mapping[str, Any], j: LongformJudgment
) -> dict[str, Any]:
    """One judged answer: the facts it states and cites, its own fact recall and citation
    recall and precision (`LongformJudgment.rates`), its tokens and time, and per unit (a
    Self-RAG segment, a baseline's sentence) what it cites and states and whether its
    citations hold that (`supported`, None: it cites nothing)."""
    return {
        "system": system,
        "id": qid,
        "question": record["question"],
        "answer": record["answer"],
        "abstained": j.abstained,
        "facts": list(j.facts),
        "stated": list(j.stated),
        "cited": list(j.cited),
        "retrieved": list(j.retrieved),
        **j.rates(),
        "citing_units": len(j.citing),
        "supported_units": sum(bool(u.supported) for u in j.citing),
        "prefill_tokens": int(record["prefill_tokens"]),
        "decode_tokens": int(record.get("decode_tokens", 0)),
        "latency_ms": float(record["latency_ms"]),
        "units": [
            {
                "text": u.text,
                "cited": list(u.cited),
                "states": list(u.states),
                "supported": u.supported,
            }
            for u in j.units
        ],
    }


def answer_rows(
    judged: Mapping[tuple[str, str], tuple[Mapping[str, Any], LongformJudgment]],
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
) -> list[dict[str, Any]]:
    """`answer_row` of every judged answer, question by question, systems in their order."""
    return [
        answer_row(system, q.id, *judged[(system, q.id)])
        for q in questions
        for system in systems
        if (system, q.id) in judged
    ]


def without_text(row: Mapping[str, Any]) -> dict[str, Any]:
    """An `answer_row` as report.json keeps it: no question, answer or unit text (those are
    in longform_answers.jsonl)."""
    kept = {k: v for k, v in row.items() if k not in ("question", "answer")}
    kept["units"] = [{k: v for k, v in u.items() if k != "text"} for u in row["units"]]
    return kept


def write_answers(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Every `answer_row`, one JSON line each."""
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def unit_marks(units: Sequence[Mapping[str, Any]]) -> str:
    """An answer's units in one short cell: per unit the facts it states ("·" none), then "+"
    its citations hold that, "-" they do not, "0" it cites nothing; e.g. "a+ ·- b0"."""
    marks = {True: "+", False: "-", None: "0"}
    return " ".join(f"{''.join(u['states']) or '·'}{marks[u['supported']]}" for u in units)
