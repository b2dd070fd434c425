"""schemas/records.py: a batch record is written with the fields it was given and nothing else;
records refuse unknown fields and error types; the eval systems' names."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import ValidationError

from selfrag.schemas.errors import ErrorKind
from selfrag.schemas.records import (
    DEFAULT_SYSTEMS,
    SYSTEMS,
    BatchRecord,
    EvalRecord,
    RecordError,
)


def test_a_batch_record_is_written_with_only_the_fields_it_was_given():
    ok = BatchRecord(id="q1", status="ok", question="Who?", response={"answer": "Rollo"})
    assert ok.to_json() == {
        "id": "q1",
        "status": "ok",
        "question": "Who?",
        "response": {"answer": "Rollo"},
    }
    duplicate = BatchRecord(id="q2", status="ok", question="Who?", duplicate_of="q1")
    assert duplicate.to_json() == {
        "id": "q2",
        "status": "ok",
        "question": "Who?",
        "duplicate_of": "q1",
    }


def test_an_unreadable_row_keeps_its_line_and_no_question():
    record = BatchRecord(
        id="line-7",
        status="error",
        question=None,
        error=RecordError(type="malformed", message="not JSON"),
        line=7,
    )
    written = json.loads(json.dumps(record.to_json()))
    assert written == {
        "id": "line-7",
        "status": "error",
        "question": None,
        "error": {"type": "malformed", "message": "not JSON"},
        "line": 7,
    }
    assert BatchRecord.model_validate(written) == record


def test_error_types_are_the_answer_errors_and_the_two_input_problems():
    for kind in (*typing.get_args(ErrorKind), "invalid", "malformed"):
        assert RecordError(type=kind, message="why").type == kind
    with pytest.raises(ValidationError):
        RecordError(type="exploded", message="?")  # type: ignore[arg-type]


def test_records_refuse_unknown_fields_and_statuses():
    with pytest.raises(ValidationError):
        BatchRecord(id="q", status="ok", extra=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        BatchRecord(id="q", status="maybe")  # type: ignore[arg-type]


def test_an_eval_record_needs_every_report_field_but_the_abstention_score():
    fields = {
        "system": "selfrag-learned",
        "id": "q",
        "question": "Who?",
        "answerable": True,
        "golds": ["Rollo"],
        "answer": "Rollo.",
        "abstained": False,
        "retrieved": True,
        "s_sup": 0.8,
        "p_ret": None,
        "cited": ["p1"],
        "cited_has_answer": [True],
        "latency_ms": 12.5,
        "prefill_tokens": 100,
        "decode_tokens": 9,
        "evidence_branches": 2,
        "branches_pruned": 1,
    }
    assert EvalRecord(**fields).abstention_score is None
    with pytest.raises(ValidationError, match="cited_has_answer"):
        EvalRecord(**{k: v for k, v in fields.items() if k != "cited_has_answer"})


def test_the_default_systems_are_systems_eval_runs():
    assert set(DEFAULT_SYSTEMS) <= set(SYSTEMS)
    assert len(set(SYSTEMS)) == len(SYSTEMS)
