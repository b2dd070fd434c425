"""The framework adapters (selfrag.integrations) with the real LangChain and LlamaIndex
packages: over a scripted answer client, then (marked real) over `SelfRAG` and its client with
SmolLM2 and embedded Qdrant."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import reduce
from operator import add
from pathlib import Path
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda
from llama_index.core.base.response.schema import Response
from llama_index.core.schema import MetadataMode, QueryBundle

from selfrag.integrations.langchain import (
    SelfRAGChatModel,
    SelfRAGRetriever,
    SelfRAGRunnable,
    to_documents,
)
from selfrag.integrations.llamaindex import SelfRAGQueryEngine
from selfrag.integrations.sources import answer_client
from selfrag.pipeline.ranking import Hypothesis
from selfrag.schemas.answer import AnswerResponse, Citation, PassageOut, SegmentOut
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.events import SegmentEvent
from selfrag.schemas.retrieval import RankedPassage, RetrieveRequest
from tests.http_fakes import FakeService, HangingService, scripted_response
from tests.paths import ROOT


def _seg(text: str, pid: str | None, score: float, s_rel: float | None) -> SegmentOut:
    return SegmentOut(
        text=text,
        citation=Citation(passage_id=pid, title=pid.upper()) if pid else None,
        retrieved=pid is not None,
        s_rel=s_rel,
        s_sup=0.5 if pid else None,
        s_use=0.25,
        is_sup="partial" if pid else None,
        logprob=-1.0,
        n_tokens=3,
        score=score,
    )


def response(question: str) -> AnswerResponse:
    """Passages c (best retrieved, uncited), a and b; b is cited first (segments 0 and 2,
    the better by ranking score being 2), then a (segment 1); segment 3 cites nothing."""
    base = scripted_response(question, DecodingConfig())
    segments = [
        _seg(" One.", "b", 1.0, 0.6),
        _seg(" Two.", "a", 2.0, 0.7),
        _seg(" Three.", "b", 3.0, 0.95),
        _seg(" Four.", None, 0.5, None),
    ]
    passages = [
        PassageOut(id="c", title="C", text="Passage c.", score=0.9),
        PassageOut(id="a", title="A", text="Passage a.", score=0.7),
        PassageOut(id="b", title="B", text="Passage b.", score=0.5),
    ]
    return base.model_copy(
        update={
            "segments": segments,
            "passages": passages,
            "answer": "One. Two. Three. Four.",
            "support": 0.4,
            "support_threshold": 0.2,
        }
    )


def abstained(question: str) -> AnswerResponse:
    """An abstention: no segments, so nothing cited, but the retrieved passages listed."""
    return response(question).model_copy(
        update={"segments": [], "abstained": True, "answer": "I don't know."}
    )


@dataclass
class FakeClient(FakeService):
    """An answer client answering from `response`: each step adds a segment, but for one where
    the leader changes first (segment 1 leads, then 0) unless `steady`. Records its requests
    (`seen`)."""

    script: Any = field(default=lambda question, _config: response(question))
    steady: bool = False

    def leaders(self, segments: list[SegmentOut]) -> list[Hypothesis]:
        leaders = [
            Hypothesis(segments=tuple(segments[: i + 1]), score=2.0) for i in range(len(segments))
        ]
        if not self.steady and len(segments) > 1:
            leaders.insert(0, Hypothesis(segments=(segments[1],), score=1.0))
        return leaders

    def calls(self) -> list[tuple[str, dict[str, Any]]]:
        """(question, dials) of each request."""
        return [(r.question, r.config.model_dump(exclude_unset=True)) for r in self.seen]


@dataclass
class Holder:
    """Holds an answer client, as `SelfRAG` does."""

    client: FakeClient


def test_adapters_take_an_answer_client_or_what_holds_one():
    fake = FakeClient()
    assert answer_client(fake) is fake and answer_client(Holder(fake)) is fake
    assert SelfRAGRunnable(Holder(fake)).client is fake
    assert SelfRAGChatModel(rag=Holder(fake)).client is fake
    assert SelfRAGChatModel(client=fake).client is fake
    assert SelfRAGQueryEngine(answerer=Holder(fake)).client is fake
    assert SelfRAGQueryEngine(client=fake).client is fake
    with pytest.raises(TypeError, match="answer client"):
        answer_client(object())  # type: ignore[arg-type]


# --- LangChain ------------------------------------------------------------------------------


RANKED = [
    RankedPassage(id="b", title="B", text="Passage b.", score=0.5, s_rel=0.9),
    RankedPassage(id="a", title="A", url="https://a", text="Passage a.", score=0.7, s_rel=0.4),
]


@dataclass
class FakeRetriever(FakeClient):
    """An answer client retrieving `RANKED`; records (query, top_k, critique) of every
    retrieval."""

    calls_made: list[tuple[str, int | None, str | None]] = field(default_factory=list)

    async def aretrieve(self, request: RetrieveRequest) -> list[RankedPassage]:
        self.calls_made.append((request.query, request.top_k, request.critique))
        return RANKED


def test_retriever_only_retrieves_in_relevance_order():
    fake = FakeRetriever()
    docs = SelfRAGRetriever(rag=Holder(fake), top_k=2, critique="likelihood").invoke("Q?")
    assert fake.calls_made == [("Q?", 2, "likelihood")] and fake.seen == []
    assert all(isinstance(d, Document) for d in docs)
    assert [d.id for d in docs] == ["b", "a"]
    assert [d.page_content for d in docs] == ["Passage b.", "Passage a."]
    assert docs[1].metadata == {
        "id": "a",
        "title": "A",
        "url": "https://a",
        "score": 0.7,
        "s_rel": 0.4,
    }
    batched = asyncio.run(SelfRAGRetriever(client=fake).abatch(["Q1", "Q2"]))
    assert [[d.id for d in ds] for ds in batched] == [["b", "a"]] * 2
    assert sorted(fake.calls_made[1:]) == [("Q1", None, None), ("Q2", None, None)]
    with pytest.raises(ValueError, match="critique"):
        SelfRAGRetriever(client=fake, critique="oracle")


def test_documents_of_an_answer_list_cited_passages_first_with_their_scores():
    docs = to_documents(response("Q?"))
    assert [d.id for d in docs] == ["b", "a", "c"]
    b, a, c = (d.metadata for d in docs)
    # b: the best of its two citing segments by ranking score is segment 2.
    assert b["segments"] == [0, 2] and b["s_rel"] == 0.95 and b["is_sup"] == "partial"
    assert a["cited"] and a["segments"] == [1] and a["s_rel"] == 0.7 and a["score"] == 0.7
    assert not c["cited"] and c["segments"] == [] and c["score"] == 0.9
    assert c["s_rel"] is c["s_sup"] is c["s_use"] is c["is_sup"] is None
    abstention = to_documents(abstained("Q?"))
    assert [d.id for d in abstention] == ["c", "a", "b"]  # the response's order
    assert not any(d.metadata["cited"] for d in abstention)


def test_chat_model_answers_with_citations_and_follows_system_messages():
    fake = FakeClient()
    model = SelfRAGChatModel(rag=fake, dials={"top_k": 2})
    reply = model.invoke([("system", "Answer in French."), ("human", "Q?")], beam=1)
    assert fake.calls() == [("Q?", {"top_k": 2, "beam": 1, "instructions": "Answer in French."})]
    assert reply.content == "One. Two. Three. Four."
    meta = reply.response_metadata
    assert [(c["segment"], c["passage_id"]) for c in meta["citations"]] == [
        (0, "b"),
        (1, "a"),
        (2, "b"),
    ]
    assert meta["citations"][1]["passage_text"] == "Passage a."
    assert meta["selfrag"]["answer"] == reply.content and meta["abstained"] is False
    assert (meta["support"], meta["support_threshold"]) == (0.4, 0.2)
    assert asyncio.run(model.ainvoke("Q?", max_tokens=64)).content == reply.content
    assert fake.calls()[-1] == ("Q?", {"top_k": 2}) and fake.seen[-1].max_tokens == 64
    with pytest.raises(ValueError, match="user message"):
        model.invoke([("system", "Only this.")])


def test_chat_model_streams_text_chunks_then_the_metadata():
    fake = FakeClient(steady=True)
    chunks = list(SelfRAGChatModel(rag=fake).stream("Q?"))
    texts = [c.content for c in chunks if c.content]
    assert texts == ["One.", " Two.", " Three.", " Four."]
    assert any(c.response_metadata.get("citations") for c in chunks[4:])
    merged = reduce(add, chunks)
    assert merged.content == "One. Two. Three. Four."
    assert [c["passage_id"] for c in merged.response_metadata["citations"]] == ["b", "a", "b"]
    # A wider beam can change its leader: the text comes in one chunk when it is done.
    # The effective config (the client's) says how wide the beam is.
    wide = list(SelfRAGChatModel(rag=FakeClient(), dials={"beam": 2}).stream("Q?"))
    assert [c.content for c in wide if c.content] == ["One. Two. Three. Four."]

    async def collect() -> list[str]:
        return [c.content async for c in SelfRAGChatModel(rag=fake).astream("Q?") if c.content]

    assert asyncio.run(collect()) == texts


def test_a_citation_of_a_passage_not_listed_is_skipped():
    r = response("Q?")
    docs = to_documents(r.model_copy(update={"passages": [r.passages[1]]}))
    assert [(d.id, d.metadata["segments"]) for d in docs] == [("a", [1])]


def test_runnable_invoke_takes_a_str_or_a_dict():
    fake = FakeClient()
    rag = SelfRAGRunnable(fake, top_k=2, mode="always")
    out = rag.invoke("Q?")
    assert set(out) == {"answer", "documents", "response"}
    assert out["answer"] == "One. Two. Three. Four."
    assert [d.id for d in out["documents"]] == ["b", "a", "c"]
    assert isinstance(out["response"], AnswerResponse) and out["response"].question == "Q?"
    rag.invoke({"question": "Q2", "dials": {"top_k": 5}, "chat_history": []})
    rag.invoke({"input": "Q3"})
    assert fake.calls() == [
        ("Q?", {"top_k": 2, "mode": "always"}),
        ("Q2", {"top_k": 5, "mode": "always"}),
        ("Q3", {"top_k": 2, "mode": "always"}),
    ]
    with pytest.raises(TypeError, match="question"):
        rag.invoke({"query": "Q?"})
    with pytest.raises(TypeError, match="question"):
        rag.invoke(42)  # type: ignore[arg-type]


def test_runnable_async_batch_and_composition():
    fake = FakeClient()
    rag = SelfRAGRunnable(fake, top_k=2)
    out = asyncio.run(rag.ainvoke("Q?"))
    assert out["answer"] and fake.calls() == [("Q?", {"top_k": 2})]
    fake.seen.clear()
    outs = rag.batch(["Q1", "Q2", "Q3"])
    assert [o["response"].question for o in outs] == ["Q1", "Q2", "Q3"]
    assert sorted(q for q, _ in fake.calls()) == ["Q1", "Q2", "Q3"]
    fake.seen.clear()
    outs = asyncio.run(rag.abatch(["Q1", "Q2"]))
    assert [o["response"].question for o in outs] == ["Q1", "Q2"]
    assert sorted(q for q, _ in fake.calls()) == ["Q1", "Q2"]
    chain = rag | RunnableLambda(lambda o: [d.metadata["title"] for d in o["documents"]])
    assert chain.invoke("Q?") == ["B", "A", "C"]


def test_runnable_streams_segment_events_then_the_output():
    fake = FakeClient()
    rag = SelfRAGRunnable(fake, top_k=2)
    chunks = list(rag.stream({"question": "Q?", "dials": {"max_segments": 4}}))
    assert fake.calls() == [("Q?", {"top_k": 2, "max_segments": 4})]
    *events, last = chunks
    assert [list(c) for c in events] == [["events"]] * 5
    assert [c["events"][0].index for c in events] == [0, 0, 1, 2, 3]
    assert set(last) == {"answer", "documents", "response"}
    assert last["answer"] == "One. Two. Three. Four."
    # The chunks add up to the output plus the events, as a chain's next step sees them.
    total = reduce(add, chunks)
    assert len(total["events"]) == 5 and total["answer"] == last["answer"]
    # A downstream step gets the summed output (Runnable.transform).
    chain = rag | RunnableLambda(lambda o: o["answer"])
    assert list(chain.stream("Q?")) == ["One. Two. Three. Four."]

    async def collect() -> list[dict[str, Any]]:
        return [c async for c in rag.astream("Q?")]

    achunks = asyncio.run(collect())
    assert fake.calls()[-1] == ("Q?", {"top_k": 2})
    assert len(achunks) == 6 and achunks[-1]["answer"] == last["answer"]


def test_leaving_a_stream_early_cancels_the_answer():
    client = HangingService()
    for _ in SelfRAGRunnable(client).stream("Q?"):
        break
    assert client.cancelled.wait(2.0)

    client = HangingService()

    async def leave() -> None:
        chunks = SelfRAGRunnable(client).astream("Q?")
        async for _ in chunks:
            break
        await chunks.aclose()  # a caller leaving early closes the generator
        assert client.cancelled.is_set()

    asyncio.run(leave())

    client = HangingService()
    for _ in SelfRAGChatModel(rag=client).stream("Q?"):
        break
    assert client.cancelled.wait(2.0)


# --- LlamaIndex -----------------------------------------------------------------------------


def test_query_engine_response_and_source_nodes():
    fake = FakeClient()
    engine = SelfRAGQueryEngine(answerer=fake, dials={"top_k": 2})
    r = engine.query("Q?")
    assert fake.calls() == [("Q?", {"top_k": 2})]
    assert isinstance(r, Response) and r.response == "One. Two. Three. Four." and str(r)
    assert [n.node_id for n in r.source_nodes] == ["b", "a", "c"]
    # Scored by s_rel of the best citing segment; an uncited passage has no score.
    assert [n.score for n in r.source_nodes] == [0.95, 0.7, None]
    b, _, c = (n.node.metadata for n in r.source_nodes)
    assert b == {
        "title": "B",
        "retrieval_score": 0.5,
        "cited": True,
        "segments": [0, 2],
        "s_rel": 0.95,
        "s_sup": 0.5,
        "s_use": 0.25,
        "is_sup": "partial",
    }
    assert not c["cited"] and c["retrieval_score"] == 0.9 and c["s_sup"] is None
    assert r.source_nodes[0].node.get_content() == "Passage b."
    # What an LLM would be shown of a node: the title and the text, not the scores.
    shown = r.source_nodes[0].node.get_content(metadata_mode=MetadataMode.LLM)
    assert shown == "title: B\n\nPassage b."
    assert r.metadata is not None
    assert r.metadata["abstained"] is False and r.metadata["critique"] == "prompted"
    assert [s["s_rel"] for s in r.metadata["segments"]] == [0.6, 0.7, 0.95, None]
    assert r.metadata["segments"][0]["citation"] == {
        "passage_id": "b",
        "title": "B",
        "url": None,
        "page": None,
        "evidence": None,
    }
    assert r.metadata["usage"]["steps"] == 2 and r.metadata["question"] == "Q?"
    assert "> Source (Doc id: b): Passage b." in r.get_formatted_sources()


def test_query_engine_async_and_query_bundle():
    fake = FakeClient()
    engine = SelfRAGQueryEngine(client=fake)
    r = asyncio.run(engine.aquery(QueryBundle("Q?")))
    assert fake.calls() == [("Q?", {})]
    assert [n.node_id for n in r.source_nodes] == ["b", "a", "c"]


def test_query_engine_abstained():
    client = FakeClient(script=lambda question, _config: abstained(question))
    r = SelfRAGQueryEngine(answerer=client).query("Q?")
    assert r.response == "I don't know." and r.metadata["abstained"] is True
    assert [n.score for n in r.source_nodes] == [None, None, None]
    assert not any(n.node.metadata["cited"] for n in r.source_nodes)
    assert r.metadata["segments"] == []


# --- installation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "framework", "extra"),
    [("langchain", "langchain_core", "langchain"), ("llamaindex", "llama_index", "llamaindex")],
)
def test_a_missing_framework_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, framework: str, extra: str
):
    for name in list(sys.modules):
        if name == framework or name.startswith(framework + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, framework, None)  # `import` raises ImportError
    monkeypatch.delitem(sys.modules, f"selfrag.integrations.{module}")
    with pytest.raises(ImportError, match=rf"'{extra}' extra"):
        importlib.import_module(f"selfrag.integrations.{module}")


OFFLINE = """
import asyncio, socket, sys
attempts = []
def refuse(self, address):
    attempts.append(address)
    raise OSError("offline")
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
from selfrag.integrations.langchain import SelfRAGRetriever, SelfRAGRunnable
from selfrag.integrations.llamaindex import SelfRAGQueryEngine
from tests.integrations.test_integrations import FakeClient
fake = FakeClient()
list(SelfRAGRunnable(fake).stream("Q?"))
engine = SelfRAGQueryEngine(answerer=fake)
r = engine.query("Q?")
r.get_formatted_sources()
asyncio.run(engine.aquery("Q?"))
from llama_index.core.schema import MetadataMode
[n.node.get_content(metadata_mode=MetadataMode.ALL) for n in r.source_nodes]
print("attempts", attempts)
"""


def test_the_adapters_work_offline():
    """Importing and using the adapters opens no connection: nothing is downloaded (LlamaIndex
    fetches NLTK data and tiktoken encodings only for its text splitters and token counters,
    which a query engine over SelfRAG never uses, and ships both in the wheel anyway)."""
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "attempts []", done.stdout + done.stderr


# --- for real ------------------------------------------------------------------------------

# Small and with the filters off: these tests are about the adapters carrying citations.
DIALS = {
    "mode": "always",
    "top_k": 2,
    "max_segments": 1,
    "max_segment_tokens": 12,
    "min_relevance": 0.0,
    "min_support_score": 0.0,
}


@pytest.fixture(scope="module")
def rag(normans_api_home: Path) -> Iterator[Any]:
    from selfrag import SelfRAG

    with SelfRAG.open(home=normans_api_home, model={"n_threads": 1}) as rag:
        yield rag


@pytest.mark.real
def test_real_langchain_retriever_ranks_without_drafting(rag: Any):
    engine = rag.system.engine
    before = engine.stats.generated_tokens
    docs = SelfRAGRetriever(rag=rag, top_k=3).invoke(
        "Who was the Norse leader who founded Normandy?"
    )
    assert engine.stats.generated_tokens == before  # read for relevance, nothing drafted
    assert len(docs) == 3
    s_rel = [d.metadata["s_rel"] for d in docs]
    assert s_rel == sorted(s_rel, reverse=True) and all(0.0 <= s <= 1.0 for s in s_rel)
    for d in docs:
        assert d.page_content and d.id == d.metadata["id"]
        assert isinstance(d.metadata["score"], float)


@pytest.mark.real
def test_real_langchain_chat_model_streams_text_with_citations(rag: Any):
    model = SelfRAGChatModel(rag=rag, dials=DIALS)
    chunks = list(model.stream("In what country is Normandy located?"))
    assert all(isinstance(c.content, str) for c in chunks)
    merged = reduce(add, chunks)
    answer = merged.response_metadata["selfrag"]["answer"]
    assert merged.content == answer and answer.strip()
    assert merged.response_metadata["citations"], merged.response_metadata
    assert len([c for c in chunks if c.content]) >= 1


@pytest.mark.real
def test_real_langchain_runnable_streams_the_answer(rag: Any):
    runnable = SelfRAGRunnable(rag.client, **DIALS)  # the client itself, as from a SelfRAG
    chunks = list(runnable.stream("In what country is Normandy located?"))
    *events, out = chunks
    assert events and all(isinstance(e, SegmentEvent) for c in events for e in c["events"])
    assert set(out) == {"answer", "documents", "response"}
    r = out["response"]
    assert out["answer"] == r.answer and r.answer.strip() and not r.abstained
    assert [d.id for d in out["documents"]] == [d.id for d in to_documents(r)]
    cited = {s.citation.passage_id for s in r.segments if s.citation}
    assert cited and {d.id for d in out["documents"] if d.metadata["cited"]} == cited


@pytest.mark.real
def test_real_llamaindex_query_engine(rag: Any):
    engine = SelfRAGQueryEngine(answerer=rag, dials=DIALS)
    r = asyncio.run(engine.aquery("Who ruled the duchy of Normandy?"))
    assert isinstance(r, Response) and r.response and r.response.strip()
    assert r.source_nodes and r.metadata is not None and not r.metadata["abstained"]
    by_id = {s["citation"]["passage_id"]: s for s in r.metadata["segments"] if s["citation"]}
    for n in r.source_nodes:
        if n.node_id in by_id:
            assert n.score == by_id[n.node_id]["s_rel"] and n.node.metadata["cited"]
        else:
            assert n.score is None and not n.node.metadata["cited"]
    assert r.source_nodes[0].score is not None
    assert isinstance(r.source_nodes[0].node.metadata["retrieval_score"], float)
