"""schemas/retrieval.py: a ranked passage is a passage with its relevance read, bounded to
[0, 1]."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from selfrag.schemas.answer import PassageOut
from selfrag.schemas.retrieval import RankedPassage


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


def test_the_read_is_required():
    with pytest.raises(ValidationError, match="s_rel"):
        RankedPassage(id="p", text="t", score=0.0)  # type: ignore[call-arg]
