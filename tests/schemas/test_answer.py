"""schemas/answer.py: what a question request accepts (visible text, bounded, a valid
collection name, a length cap) and the bounds of a segment's scores."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from selfrag.schemas.answer import (
    MAX_QUESTION_CHARS,
    AnswerRequest,
    Citation,
    SegmentOut,
)
from selfrag.schemas.decoding import MAX_ANSWER_TOKENS


def test_a_question_is_stripped_and_its_config_defaults_to_no_override():
    request = AnswerRequest(question="  Who ruled Normandy?\n")
    assert request.question == "Who ruled Normandy?"
    assert request.config.model_dump(exclude_unset=True) == {}
    assert request.collection is None and request.max_tokens is None


def test_a_request_of_keyword_dials_keeps_its_length_cap_and_collection_apart():
    request = AnswerRequest.of("Who?", top_k=2, max_tokens=64, collection="docs")
    assert request.config.model_dump(exclude_unset=True) == {"top_k": 2}
    assert request.max_tokens == 64 and request.collection == "docs"
    with pytest.raises(ValidationError, match="not_a_dial"):
        AnswerRequest.of("Who?", not_a_dial=1)


@pytest.mark.parametrize(
    "question", ["", "   ", "\u200b\u200b", "\x00\x1b", "\u3164", "\x1b[2J\x07", "\x1b]0;x\x07"]
)
def test_a_question_without_visible_text_is_refused(question: str):
    with pytest.raises(ValidationError, match="question"):
        AnswerRequest(question=question)


def test_a_question_over_the_limit_is_refused():
    AnswerRequest(question="x" * MAX_QUESTION_CHARS)
    with pytest.raises(ValidationError, match="question"):
        AnswerRequest(question="x" * (MAX_QUESTION_CHARS + 1))


def test_unknown_fields_a_bad_collection_and_an_out_of_range_cap_are_refused():
    with pytest.raises(ValidationError):
        AnswerRequest(question="Q?", temperature=0.2)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="collection"):
        AnswerRequest(question="Q?", collection="../etc")
    with pytest.raises(ValidationError, match="max_tokens"):
        AnswerRequest(question="Q?", max_tokens=3)
    with pytest.raises(ValidationError, match="max_tokens"):
        AnswerRequest(question="Q?", max_tokens=MAX_ANSWER_TOKENS + 1)
    assert AnswerRequest(question="Q?", max_tokens=MAX_ANSWER_TOKENS).max_tokens


def test_a_requests_config_refuses_a_dial_out_of_its_bounds():
    with pytest.raises(ValidationError, match="min_relevance"):
        AnswerRequest.model_validate({"question": "Q?", "config": {"min_relevance": 1.5}})


def test_segment_scores_and_citation_pages_keep_their_bounds():
    base = {"text": "t", "retrieved": True, "logprob": -1.0, "n_tokens": 1, "score": 0.0}
    SegmentOut(**base, s_rel=1.0, s_sup=0.0, s_use=-1.0)
    for bad in ({"s_rel": 1.1}, {"s_sup": -0.1}, {"s_use": -1.5}, {"p_ret": 2.0}):
        with pytest.raises(ValidationError):
            SegmentOut(**base, **bad)
    with pytest.raises(ValidationError, match="page"):
        Citation(passage_id="p", page=0)
