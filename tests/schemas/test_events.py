"""schemas/events.py: the events of a streamed answer carry their segment or error as sent,
and refuse what a client could not read."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from selfrag.schemas.answer import SegmentOut
from selfrag.schemas.events import ErrorEvent, SegmentEvent


def _segment(text: str = "Rollo founded it.") -> SegmentOut:
    return SegmentOut(text=text, retrieved=True, s_sup=0.8, logprob=-2.0, n_tokens=4, score=0.5)


def test_a_segment_event_round_trips_through_json():
    event = SegmentEvent(
        index=1,
        segment=_segment(),
        hypothesis_score=-0.4,
    )
    assert SegmentEvent.model_validate_json(event.model_dump_json()) == event


def test_a_segment_index_is_never_negative():
    with pytest.raises(ValidationError, match="index"):
        SegmentEvent(index=-1, segment=_segment(), hypothesis_score=0.0)


def test_events_refuse_unknown_fields():
    with pytest.raises(ValidationError):
        SegmentEvent(
            index=0,
            segment=_segment(),
            hypothesis_score=0.0,
            beam=[],  # type: ignore[call-arg]
        )
    with pytest.raises(ValidationError):
        ErrorEvent(error="x", detail="y", status=500, trace="secret")  # type: ignore[call-arg]


def test_an_error_event_carries_a_structured_detail_and_an_optional_request_id():
    event = ErrorEvent(error="deadline_exceeded", detail={"timeout_s": 5}, status=504)
    assert event.model_dump() == {
        "error": "deadline_exceeded",
        "detail": {"timeout_s": 5},
        "status": 504,
        "request_id": None,
    }
