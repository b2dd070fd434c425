"""jobs/evaluation/abstention.py: Self-RAG's abstention score is its support's margin over the
threshold its passage was held to, so one number orders answers held to different thresholds."""

from __future__ import annotations

import pytest

from selfrag.jobs.evaluation.abstention import abstention_score
from selfrag.schemas.decoding import DecodingConfig
from tests.http_fakes import scripted_response


def test_selfrag_is_scored_by_its_support_above_its_threshold() -> None:
    response = scripted_response("q", DecodingConfig())
    held = response.model_copy(update={"support": 0.5, "support_threshold": 0.4})
    assert abstention_score("selfrag-learned", held) == pytest.approx(0.1)
    # A branch held to a higher threshold with more support can rank below it.
    higher = response.model_copy(update={"support": 0.55, "support_threshold": 0.5})
    assert abstention_score("selfrag-learned", higher) < abstention_score("selfrag-learned", held)
    off = response.model_copy(update={"support": 0.5, "support_threshold": None})
    assert abstention_score("selfrag-learned", off) == pytest.approx(0.5)
    unread = response.model_copy(update={"support": None, "support_threshold": 0.4})
    assert abstention_score("selfrag-learned", unread) is None
