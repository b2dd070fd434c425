"""schemas/retrieval.py: a ranked passage is a passage with its relevance read, bounded to
[0, 1] (none when the store's order was asked for); a retrieval request is checked like a
question."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from selfrag.schemas.answer import PassageOut
from selfrag.schemas.retrieval import RankedPassage, RetrieveRequest


def test_a_ranked_passage_is_a_passage_with_its_read():
    ranked = RankedPassage(id="p", text="Body.", score=0.4, similarity=0.7, s_rel=0.9)
    assert isinstance(ranked, PassageOut)
    assert ranked.model_dump() == {
        "id": "p",
        "title": None,
        "url": None,
        "text": "Body.",
        "score": 0.4,
        "similarity": 0.7,
        "corpus": None,
        "s_rel": 0.9,
    }


@pytest.mark.parametrize("s_rel", [-0.01, 1.01])
def test_a_read_outside_zero_to_one_is_refused(s_rel: float):
    with pytest.raises(ValidationError, match="s_rel"):
        RankedPassage(id="p", text="t", score=0.0, s_rel=s_rel)


def test_the_read_is_none_in_the_stores_order():
    assert RankedPassage(id="p", text="t", score=0.0).s_rel is None


def test_a_retrieval_request_is_checked_like_a_question():
    request = RetrieveRequest(query="  Who founded Normandy? ")
    assert request.query == "Who founded Normandy?"
    assert (request.top_k, request.critique, request.order) == (None, None, "relevance")
    for bad in ({"query": "\u200b "}, {"query": "q", "top_k": 0}, {"query": "q", "order": "x"}):
        with pytest.raises(ValidationError):
            RetrieveRequest.model_validate(bad)
    with pytest.raises(ValidationError, match="critique"):
        RetrieveRequest(query="q", critique="oracle")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="collection"):
        RetrieveRequest(query="q", collection="../x")
