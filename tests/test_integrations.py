"""The framework adapters (selfrag.integrations) with the real LangChain and LlamaIndex
packages: over a scripted answerer, then (marked real) over `SelfRAG` with SmolLM2 and
embedded Qdrant."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
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

from selfrag.integrations.langchain import SelfRAGRetriever, SelfRAGRunnable, to_documents
from selfrag.integrations.llamaindex import SelfRAGQueryEngine
from selfrag.integrations.sources import Answerer, StreamingAnswerer
from selfrag.schemas.answer import AnswerResponse, Citation, PassageOut, SegmentOut
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.events import SegmentEvent
from tests.http_fakes import scripted_response

ROOT = Path(__file__).resolve().parents[1]


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
        update={"segments": segments, "passages": passages, "answer": "One. Two. Three. Four."}
    )


def abstained(question: str) -> AnswerResponse:
    """An abstention: no segments, so nothing cited, but the retrieved passages listed."""
    return response(question).model_copy(
        update={"segments": [], "abstained": True, "answer": "I don't know."}
    )


class _Events:
    """What `SelfRAG.stream` returns: segment events, then `.response`."""

    def __init__(self, r: AnswerResponse) -> None:
        self._r = r
        self.response: AnswerResponse | None = None
        # The leader changes after the first step: index 0 is sent twice.
        first = r.segments[1]
        self.events = [SegmentEvent(index=0, segment=first, hypothesis_score=1.0)] + [
            SegmentEvent(index=i, segment=s, hypothesis_score=2.0) for i, s in enumerate(r.segments)
        ]

    def __iter__(self) -> Iterator[SegmentEvent]:
        yield from self.events
        self.response = self._r

    async def __aiter__(self) -> AsyncIterator[SegmentEvent]:
        for e in self.events:
            yield e
        self.response = self._r


@dataclass
class FakeAnswerer:
    """Answers from a script; records (method, question, dials) of every call."""

    script: Any = response
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)

    def answer(self, question: str, **dials: Any) -> AnswerResponse:
        self.calls.append(("answer", question, dials))
        return self.script(question)

    async def aanswer(self, question: str, **dials: Any) -> AnswerResponse:
        self.calls.append(("aanswer", question, dials))
        await asyncio.sleep(0)
        return self.script(question)


@dataclass
class FakeStreamer(FakeAnswerer):
    def stream(self, question: str, **dials: Any) -> _Events:
        self.calls.append(("stream", question, dials))
        return _Events(self.script(question))

    def astream(self, question: str, **dials: Any) -> _Events:
        self.calls.append(("astream", question, dials))
        return _Events(self.script(question))


def test_the_fakes_are_answerers():
    assert isinstance(FakeAnswerer(), Answerer)
    assert not isinstance(FakeAnswerer(), StreamingAnswerer)
    assert isinstance(FakeStreamer(), StreamingAnswerer)


# --- LangChain ------------------------------------------------------------------------------


def test_retriever_lists_cited_passages_first_with_their_scores():
    fake = FakeAnswerer()
    docs = SelfRAGRetriever(answerer=fake, dials={"top_k": 2, "mode": "always"}).invoke("Q?")
    assert fake.calls == [("answer", "Q?", {"top_k": 2, "mode": "always"})]
    assert all(isinstance(d, Document) for d in docs)
    assert [d.id for d in docs] == ["b", "a", "c"]
    assert [d.page_content for d in docs] == ["Passage b.", "Passage a.", "Passage c."]
    b, a, c = (d.metadata for d in docs)
    # b: the best of its two citing segments by ranking score is segment 2.
    assert b == {
        "id": "b",
        "title": "B",
        "score": 0.5,
        "cited": True,
        "segments": [0, 2],
        "s_rel": 0.95,
        "s_sup": 0.5,
        "s_use": 0.25,
        "is_sup": "partial",
        "answer": "One. Two. Three. Four.",
    }
    assert a["cited"] and a["segments"] == [1] and a["s_rel"] == 0.7 and a["score"] == 0.7
    assert not c["cited"] and c["segments"] == [] and c["score"] == 0.9
    assert c["s_rel"] is c["s_sup"] is c["s_use"] is c["is_sup"] is None


def test_retriever_async_calls_aanswer():
    fake = FakeAnswerer()
    retriever = SelfRAGRetriever(answerer=fake, dials={"top_k": 2})
    docs = asyncio.run(retriever.ainvoke("Q?"))
    assert fake.calls == [("aanswer", "Q?", {"top_k": 2})]
    assert [d.id for d in docs] == ["b", "a", "c"]
    batched = asyncio.run(retriever.abatch(["Q1", "Q2"]))
    assert [[d.id for d in ds] for ds in batched] == [["b", "a", "c"]] * 2


def test_abstained_answer_lists_the_passages_uncited():
    docs = SelfRAGRetriever(answerer=FakeAnswerer(script=abstained)).invoke("Q?")
    assert [d.id for d in docs] == ["c", "a", "b"]  # the response's order: retrieval score
    assert not any(d.metadata["cited"] for d in docs)
    assert all(d.metadata["answer"] == "I don't know." for d in docs)


def test_a_citation_of_a_passage_not_listed_is_skipped():
    r = response("Q?")
    docs = to_documents(r.model_copy(update={"passages": [r.passages[1]]}))
    assert [(d.id, d.metadata["segments"]) for d in docs] == [("a", [1])]


def test_runnable_invoke_takes_a_str_or_a_dict():
    fake = FakeAnswerer()
    rag = SelfRAGRunnable(fake, top_k=2, mode="always")
    out = rag.invoke("Q?")
    assert set(out) == {"answer", "documents", "response"}
    assert out["answer"] == "One. Two. Three. Four."
    assert [d.id for d in out["documents"]] == ["b", "a", "c"]
    assert isinstance(out["response"], AnswerResponse) and out["response"].question == "Q?"
    rag.invoke({"question": "Q2", "dials": {"top_k": 5}, "chat_history": []})
    rag.invoke({"input": "Q3"})
    assert fake.calls == [
        ("answer", "Q?", {"top_k": 2, "mode": "always"}),
        ("answer", "Q2", {"top_k": 5, "mode": "always"}),
        ("answer", "Q3", {"top_k": 2, "mode": "always"}),
    ]
    with pytest.raises(TypeError, match="question"):
        rag.invoke({"query": "Q?"})
    with pytest.raises(TypeError, match="question"):
        rag.invoke(42)  # type: ignore[arg-type]


def test_runnable_async_batch_and_composition():
    fake = FakeAnswerer()
    rag = SelfRAGRunnable(fake, top_k=2)
    out = asyncio.run(rag.ainvoke("Q?"))
    assert out["answer"] and fake.calls == [("aanswer", "Q?", {"top_k": 2})]
    fake.calls.clear()
    outs = rag.batch(["Q1", "Q2", "Q3"])
    assert [o["response"].question for o in outs] == ["Q1", "Q2", "Q3"]
    assert sorted(c[1] for c in fake.calls) == ["Q1", "Q2", "Q3"]
    assert {c[0] for c in fake.calls} == {"answer"}
    fake.calls.clear()
    outs = asyncio.run(rag.abatch(["Q1", "Q2"]))
    assert [o["response"].question for o in outs] == ["Q1", "Q2"]
    assert {c[0] for c in fake.calls} == {"aanswer"}
    chain = rag | RunnableLambda(lambda o: [d.metadata["title"] for d in o["documents"]])
    assert chain.invoke("Q?") == ["B", "A", "C"]


def test_runnable_streams_segment_events_then_the_output():
    fake = FakeStreamer()
    rag = SelfRAGRunnable(fake, top_k=2)
    chunks = list(rag.stream({"question": "Q?", "dials": {"max_segments": 4}}))
    assert fake.calls == [("stream", "Q?", {"top_k": 2, "max_segments": 4})]
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
    assert fake.calls[-1] == ("astream", "Q?", {"top_k": 2})
    assert len(achunks) == 6 and achunks[-1]["answer"] == last["answer"]


class _Closing(_Events):
    """Records when the consumer stops iterating, as `SegmentStream` stops its decode."""

    closed: list[str]

    def __iter__(self) -> Iterator[SegmentEvent]:
        try:
            yield from super().__iter__()
        finally:
            self.closed.append("stream")

    async def __aiter__(self) -> AsyncIterator[SegmentEvent]:
        try:
            async for e in super().__aiter__():
                yield e
        finally:
            self.closed.append("astream")


def test_leaving_a_stream_early_closes_the_answerers_stream():
    closed: list[str] = []

    @dataclass
    class Closer(FakeStreamer):
        def stream(self, question: str, **dials: Any) -> _Events:
            events = _Closing(self.script(question))
            events.closed = closed
            return events

        astream = stream

    rag = SelfRAGRunnable(Closer())
    for _ in rag.stream("Q?"):
        break
    assert closed == ["stream"]

    async def leave() -> None:
        chunks = rag.astream("Q?")
        async for _ in chunks:
            break
        await chunks.aclose()  # a caller leaving early closes the generator
        assert closed == ["stream", "astream"]

    asyncio.run(leave())


def test_runnable_without_stream_yields_one_chunk():
    fake = FakeAnswerer()
    rag = SelfRAGRunnable(fake)
    [chunk] = list(rag.stream("Q?"))
    assert set(chunk) == {"answer", "documents", "response"}

    async def collect() -> list[dict[str, Any]]:
        return [c async for c in rag.astream("Q?")]

    [achunk] = asyncio.run(collect())
    assert achunk["answer"] == chunk["answer"]
    assert [c[0] for c in fake.calls] == ["answer", "aanswer"]


# --- LlamaIndex -----------------------------------------------------------------------------


def test_query_engine_response_and_source_nodes():
    fake = FakeAnswerer()
    engine = SelfRAGQueryEngine(answerer=fake, dials={"top_k": 2})
    r = engine.query("Q?")
    assert fake.calls == [("answer", "Q?", {"top_k": 2})]
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
        "evidence": None,
    }
    assert r.metadata["usage"]["steps"] == 2 and r.metadata["question"] == "Q?"
    assert "> Source (Doc id: b): Passage b." in r.get_formatted_sources()


def test_query_engine_async_and_query_bundle():
    fake = FakeAnswerer()
    engine = SelfRAGQueryEngine(answerer=fake)
    r = asyncio.run(engine.aquery(QueryBundle("Q?")))
    assert fake.calls == [("aanswer", "Q?", {})]
    assert [n.node_id for n in r.source_nodes] == ["b", "a", "c"]


def test_query_engine_abstained():
    r = SelfRAGQueryEngine(answerer=FakeAnswerer(script=abstained)).query("Q?")
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
    with pytest.raises(ImportError, match=rf"pip install 'selfrag\[{extra}\]'"):
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
from tests.test_integrations import FakeStreamer
fake = FakeStreamer()
SelfRAGRetriever(answerer=fake).invoke("Q?")
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
def test_real_langchain_retriever(rag: Any):
    assert isinstance(rag, StreamingAnswerer)
    docs = SelfRAGRetriever(answerer=rag, dials=DIALS).invoke(
        "Who was the Norse leader who founded Normandy?"
    )
    assert 1 <= len(docs) <= 2, docs
    assert docs[0].metadata["cited"], docs
    assert [d.metadata["cited"] for d in docs] == sorted(
        (d.metadata["cited"] for d in docs), reverse=True
    )
    for d in docs:
        assert d.page_content and d.id == d.metadata["id"]
        assert isinstance(d.metadata["score"], float)
        assert d.metadata["answer"].strip()
    first = docs[0].metadata
    assert 0.0 <= first["s_rel"] <= 1.0 and 0.0 <= first["s_sup"] <= 1.0
    assert first["is_sup"] in {"none", "partial", "full"} and first["segments"] == [0]


@pytest.mark.real
def test_real_langchain_runnable_streams_the_answer(rag: Any):
    chunks = list(SelfRAGRunnable(rag, **DIALS).stream("In what country is Normandy located?"))
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
