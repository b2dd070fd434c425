"""jobs/evaluation/longform_report.py: records judged against their question's facts, the
per-system row with tokens and time, paired counts per question and per fact, the answers
file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from selfrag.jobs.evaluation.eval_questions import EvalQuestion
from selfrag.jobs.evaluation.longform_report import (
    answer_row,
    judge_record,
    longform_pairs,
    longform_row,
    unit_marks,
    without_text,
    write_answers,
)
from selfrag.pipeline.evaluation.longform_metrics import Fact

QUESTION = EvalQuestion(
    id="q",
    question="Who founded Normandy, and where is it?",
    golds=("Rollo", "France"),
    answerable=True,
    facts=(Fact("a", ("Rollo",)), Fact("b", ("France",))),
)


def _record(answer: str, units: list[dict[str, Any]] | None, ms: float) -> dict[str, Any]:
    return {
        "system": "s",
        "id": "q",
        "question": QUESTION.question,
        "answer": answer,
        "abstained": False,
        "latency_ms": ms,
        "prefill_tokens": 100,
        "decode_tokens": 20,
        "units": units,
        "passages": [
            {"id": "p1", "title": "Normandy", "text": "Rollo founded Normandy."},
            {"id": "p2", "title": "Normandy", "text": "Normandy is in France."},
        ],
    }


def test_records_are_judged_and_compared_per_question_and_per_fact(tmp_path: Path):
    both = _record(
        "Rollo founded it. It is in France.",
        [
            {"text": "Rollo founded it.", "cited": ["p1"]},
            {"text": "It is in France.", "cited": ["p1"]},
        ],
        10.0,
    )
    one = _record("Rollo founded it.", [{"text": "Rollo founded it.", "cited": ["p1"]}], 30.0)
    jb, jo = judge_record(both, QUESTION), judge_record(one, QUESTION)
    assert jb is not None and jo is not None
    assert jb.stated == ("a", "b") and jb.cited == ("a",)  # France is cited to p1, lacking it
    assert jo.stated == ("a",) and jo.cited == ("a",)
    assert judge_record(_record("Rollo", None, 1.0), QUESTION) is None  # written without units

    row = longform_row([(both, jb), (one, jo)])
    assert row["fact_recall"] == pytest.approx(3 / 4) and row["fully_covered"] == 0.5
    assert row["citation_recall"] == pytest.approx(2 / 3)
    assert row["citation_precision"] == pytest.approx(2 / 3)
    assert row["prefill_tokens"] == 100.0 and row["decode_tokens"] == 20.0
    assert row["mean_ms"] == 20.0 and row["p50_ms"] == 20.0

    counts = longform_pairs([(jb, jo), (jo, jo)])
    # Per question: "both" covers q once, "one" never; per fact: a stated by both twice, b by
    # the first only once and by neither once.
    assert (counts["fully_covered"].only_first, counts["fully_covered"].neither) == (1, 1)
    facts = counts["facts_stated"]
    assert (facts.both, facts.only_first, facts.only_second, facts.neither) == (2, 1, 0, 1)

    path = write_answers(tmp_path / "answers.jsonl", [answer_row("s", "q", both, jb)])
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["stated"] == ["a", "b"] and line["cited"] == ["a"]
    # The answer's own rates: both facts stated, one cited to a passage holding it, one of
    # its two citing units supported.
    assert (line["fact_recall"], line["citation_recall"], line["citation_precision"]) == (
        1.0,
        0.5,
        0.5,
    )
    assert (line["citing_units"], line["supported_units"]) == (2, 1)
    assert (line["prefill_tokens"], line["decode_tokens"], line["latency_ms"]) == (100, 20, 10.0)
    assert unit_marks(line["units"]) == "a+ b-"
    kept = without_text(line)
    assert "answer" not in kept and "text" not in kept["units"][0] and kept["stated"] == ["a", "b"]
    assert line["units"][1] == {
        "text": "It is in France.",
        "cited": ["p1"],
        "states": ["b"],
        "supported": False,
    }
