"""The whole path for real: SmolLM2 through llama.cpp, embedded Qdrant, the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from selfrag.api import SelfRAG
from selfrag.infra.settings_loader import load_settings
from selfrag.schemas.answer import AnswerResponse
from tests.real import real
from tests.suite import SUITE_ENV


@pytest.fixture(scope="module")
@real
def rag(indexed_home: Path):
    settings = load_settings(environ={"SELFRAG_HOME": str(indexed_home), **SUITE_ENV})
    with SelfRAG(settings) as api:
        yield api


def _check_ranges(r: AnswerResponse) -> None:
    assert r.answer.strip()
    for seg in r.segments:
        for v in (seg.p_ret, seg.s_rel, seg.s_sup):
            assert v is None or 0.0 <= v <= 1.0
        assert seg.s_use is None or -1.0 <= seg.s_use <= 1.0
        assert seg.logprob <= 0.0


def test_ask_always_retrieves_and_cites(rag: SelfRAG):
    r = rag.answer(
        "Who was the Norse leader who founded Normandy?",
        # Filters off: this test is about citing; abstention has tests of its own.
        mode="always",
        top_k=3,
        max_segments=2,
        min_relevance=0.0,
        min_support_score=0.0,
    )
    _check_ranges(r)
    cited = [s for s in r.segments if s.citation is not None]
    assert cited, r.model_dump_json(indent=2)
    seg = cited[0]
    assert seg.s_rel is not None and seg.s_sup is not None and seg.s_use is not None
    assert seg.citation.passage_id in {p.id for p in r.passages}
    assert r.usage.retrievals >= 1 and r.usage.branches_opened >= 4
    assert r.usage.prefill_tokens > 0 and r.usage.decode_tokens > 0
    # auto: the embedded default ships reflection heads for its model file.
    assert r.critique == "learned"


def test_never_mode_answers_closed_book(rag: SelfRAG):
    r = rag.answer("What is the capital of France?", mode="never", max_segments=1)
    _check_ranges(r)
    assert r.usage.retrievals == 0
    assert all(s.citation is None for s in r.segments)


def test_strict_support_filter_never_returns_an_empty_answer(rag: SelfRAG):
    r = rag.answer(
        "What colour is the planet Neptune's third moon's ocean?",
        mode="always",
        min_support="full",
        max_segments=1,
        top_k=2,
    )
    assert r.answer.strip()
    if r.abstained:
        assert "evidence" in r.answer
