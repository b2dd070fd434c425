"""The Python API (`from selfrag import SelfRAG`) for real: SmolLM2 through llama.cpp and
embedded Qdrant in a home of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from selfrag import SelfRAG
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.events import SegmentEvent
from tests.real import real

SMALL = {"mode": "always", "top_k": 2, "max_segments": 2, "max_segment_tokens": 12}
# Filters off: these tests are about the API carrying citations, not about abstention.
OPEN = {"min_relevance": 0.0, "min_support_score": 0.0}


@pytest.fixture(scope="module")
@real
def rag(normans_api_home: Path) -> Iterator[SelfRAG]:
    # The home was indexed through `SelfRAG.index` (tests/conftest.py checks its report).
    with SelfRAG.open(home=normans_api_home, model={"n_threads": 1}) as rag:
        assert rag.count() > 0
        yield rag
    assert "model" not in rag.system.__dict__ and "store" not in rag.system.__dict__


def _cited(r: AnswerResponse) -> None:
    assert r.answer.strip() and not r.abstained, r.model_dump_json(indent=2)
    assert any(s.citation is not None for s in r.segments)
    assert {s.citation.passage_id for s in r.segments if s.citation} <= {p.id for p in r.passages}


def test_answer_takes_dials_and_cites(rag: SelfRAG):
    r = rag.answer("Who was the Norse leader who founded Normandy?", **SMALL, **OPEN)
    _cited(r)
    assert r.config.top_k == 2 and r.config.max_segment_tokens == 12
    assert all(s.n_tokens <= 12 for s in r.segments)
    capped = rag.answer("Who was the Norse leader?", max_tokens=6, **SMALL, **OPEN)
    assert capped.config.max_segment_tokens == 6 and capped.config.max_answer_tokens == 6
    assert sum(s.n_tokens for s in capped.segments) <= 6


def test_stream_yields_segments_then_keeps_the_response(rag: SelfRAG):
    stream = rag.stream("In what country is Normandy located?", **SMALL, **OPEN)
    events = list(stream)
    assert events and all(isinstance(e, SegmentEvent) for e in events)
    assert stream.response is not None
    _cited(stream.response)
    # Index i replaces what was at i and after: replaying the events gives the answer.
    shown: list = []
    for e in events:
        shown[e.index :] = [e.segment]
    assert shown == stream.response.segments


def test_async_twins(rag: SelfRAG):
    async def both() -> tuple[AnswerResponse, list[SegmentEvent], AnswerResponse | None]:
        r = await rag.aanswer("When were the Normans in Normandy?", **SMALL, **OPEN)
        stream = rag.astream("Who ruled the duchy of Normandy?", **SMALL, **OPEN)
        events = [e async for e in stream]
        return r, events, stream.response

    r, events, streamed = asyncio.run(both())
    _cited(r)
    assert events and streamed is not None and streamed.segments


def test_leaving_a_stream_early_stops_it(rag: SelfRAG):
    for _ in rag.stream("What is the Norman language?", mode="always", top_k=2, max_segments=4):
        break
    # The engine is free again: the abandoned decode ended at its next step.
    r = rag.answer("What is the Norman language?", mode="never", max_segments=1)
    assert r.answer


def test_bad_input_is_refused_before_any_work(rag: SelfRAG, tmp_path: Path):
    with pytest.raises(ValidationError, match="top_k"):
        rag.answer("q", top_k=0)
    with pytest.raises(ValidationError, match="not_a_dial"):
        rag.answer("q", not_a_dial=1)
    with pytest.raises(ValidationError, match="question"):
        rag.answer("   ")
    with pytest.raises(FileNotFoundError):
        rag.index(tmp_path / "missing.jsonl")


def test_the_http_app_answers_through_the_apis_client_without_serve(rag: SelfRAG):
    from fastapi.testclient import TestClient

    from selfrag.actors.http.routes import build_local_http_app
    from tests.http_fakes import metric_value

    http = TestClient(build_local_http_app(rag.client))
    body = {"question": "Who founded Normandy?", "config": {**SMALL, **OPEN}}
    r = http.post("/v1/answer", json=body)
    assert r.status_code == 200, r.text
    _cited(AnswerResponse.model_validate(r.json()))
    metrics = http.get("/metrics").text
    assert metric_value(metrics, "selfrag_answers_total") == 1.0
    assert metric_value(metrics, "selfrag_decoding_steps_total") >= 1.0
    ready = http.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"model": True, "store": True, "cache": True}


def test_retrieve_ranks_by_relevance_under_the_configured_defaults(rag: SelfRAG):
    question = "Who was the Norse leader who founded Normandy?"
    default = rag.retrieve(question)
    assert len(default) == rag.settings.decoding.top_k
    two = rag.retrieve(question, top_k=2, critique="learned")
    assert len(two) == 2
    assert [p.s_rel for p in two] == sorted((p.s_rel for p in two), reverse=True)
    assert {p.id for p in two} <= {p.id for p in rag.retrieve(question, top_k=5)}
    with pytest.raises(ValidationError, match="top_k"):
        rag.retrieve(question, top_k=0)
    with pytest.raises(ValidationError, match="critique"):
        rag.retrieve(question, critique="oracle")
