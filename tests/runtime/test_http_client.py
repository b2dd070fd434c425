"""runtime/http_client.py: the answer client over a selfrag HTTP app, here over a scripted
service under a real uvicorn socket: the same results and errors as the service gives in
process, nothing done on a server of another home, and the framework adapters working through
it. (`SelfRAG.open(url=...)` against a real `selfrag serve`:
tests/system/test_entry_points_agree.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.routes import build_http_app
from selfrag.api import SelfRAG, ServedElsewhere
from selfrag.runtime.answer_client import AnswerClient
from selfrag.runtime.http_client import (
    HTTPAnswerClient,
    ServerRefused,
    WrongServer,
    api_key_from,
)
from selfrag.schemas.answer import AnswerRequest
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.documents import DocumentInfo, Removal
from selfrag.schemas.errors import DependencyDown, Overloaded, Unprocessable
from selfrag.schemas.retrieval import RetrieveRequest
from tests.http_fakes import SERVED, FakeService, live_server, scripted_response
from tests.redis_proc import free_port

KEY = "k1"
REQUEST = AnswerRequest(question="Who founded Normandy?", config={"top_k": 2})


class Documents:
    """The documents routes' service over a list; records removals."""

    def __init__(self) -> None:
        self.docs = [DocumentInfo(id="d1", passages=2), DocumentInfo(id="d2", passages=1)]
        self.removed: list[str] = []

    async def documents(self) -> list[DocumentInfo]:
        return list(self.docs)

    async def remove(self, refs: list[str]) -> Removal:
        hit = [d for d in self.docs if d.id in refs]
        self.docs = [d for d in self.docs if d not in hit]
        self.removed += [d.id for d in hit]
        return Removal(
            documents=[d.id for d in hit],
            passages=sum(d.passages for d in hit),
            unmatched=[r for r in refs if r not in {d.id for d in hit}],
        )


@pytest.fixture
def served() -> Iterator[tuple[str, FakeService, Documents]]:
    service, docs = FakeService(), Documents()
    app = build_http_app(
        service, Metrics(), api_keys=[SecretStr(KEY)], documents=docs, readiness_ttl_s=0.0
    )
    with live_server(app) as url:
        yield url, service, docs


def _client(url: str, **kw: object) -> HTTPAnswerClient:
    return HTTPAnswerClient(url, api_key=KEY, **kw)  # type: ignore[arg-type]


def test_it_is_an_answer_client_with_the_services_results(served) -> None:
    url, service, _ = served
    client = _client(url)
    assert isinstance(client, AnswerClient)
    answer = client.answer(REQUEST)
    config = DecodingConfig(top_k=2)
    assert answer.response == scripted_response(REQUEST.question, config)
    assert answer.cache == "miss" and service.seen == [REQUEST]
    assert client.config(REQUEST) == config
    assert asyncio.run(client.aanswer(REQUEST)).response == answer.response
    health = asyncio.run(client.health())
    assert health.ready and health.served == SERVED
    [passage] = client.retrieve(RetrieveRequest(query="Who?", top_k=1, order="retriever"))
    assert passage.id == "p1" and passage.s_rel is None
    assert service.retrieved[-1] == RetrieveRequest(query="Who?", top_k=1, order="retriever")


def test_a_stream_hands_each_leader_on_and_ends_with_the_answer(served) -> None:
    url, _, _ = served
    stream = _client(url).stream(REQUEST)
    events = list(stream)
    assert [e.index for e in events] == [0, 1]
    assert stream.response == scripted_response(REQUEST.question, DecodingConfig(top_k=2))

    async def collect() -> list[int]:
        return [e.index async for e in _client(url).stream(REQUEST)]

    assert asyncio.run(collect()) == [0, 1]


def test_the_servers_errors_are_the_kinds_raised_in_process(served) -> None:
    url, service, _ = served
    service.fail = Overloaded("busy")
    with pytest.raises(Overloaded, match="busy"):
        _client(url).answer(REQUEST)
    with pytest.raises(Overloaded, match="busy"):
        list(_client(url).stream(REQUEST))
    service.fail = Unprocessable("no such critique here")
    with pytest.raises(Unprocessable, match="no such critique"):
        _client(url).answer(REQUEST)
    with pytest.raises(ServerRefused) as refused:
        HTTPAnswerClient(url, api_key="wrong").answer(REQUEST)
    assert refused.value.status == 401
    with pytest.raises(DependencyDown, match="does not answer"):
        HTTPAnswerClient(f"http://127.0.0.1:{free_port()}").answer(REQUEST)


def test_documents_are_listed_and_removed_with_a_key(served) -> None:
    url, _, docs = served
    client = _client(url)
    assert [d.id for d in asyncio.run(client.documents())] == ["d1", "d2"]
    removal = asyncio.run(client.remove(["d1", "nope"]))
    assert (removal.documents, removal.passages, removal.unmatched) == (["d1"], 2, ["nope"])
    assert docs.removed == ["d1"]


def test_a_server_of_another_home_or_collection_does_nothing_it_is_asked(served) -> None:
    url, service, docs = served
    other_home = _client(url, home_id="1" * 32, collection=SERVED.collection)
    for call in (
        lambda: other_home.answer(REQUEST),
        lambda: asyncio.run(other_home.remove(["d1"])),
        lambda: asyncio.run(other_home.documents()),
        lambda: other_home.retrieve(RetrieveRequest(query="q")),
        lambda: list(other_home.stream(REQUEST)),
    ):
        with pytest.raises(WrongServer, match=SERVED.home_id):
            call()
    assert service.seen == [] and service.retrieved == [] and docs.removed == []
    other_collection = _client(url, home_id=SERVED.home_id, collection="elsewhere")
    with pytest.raises(WrongServer, match="passages"):
        asyncio.run(other_collection.remove(["d1"]))
    # A call may name its own collection; the home and collection served pass.
    this = _client(url, home_id=SERVED.home_id, collection=SERVED.collection)
    with pytest.raises(WrongServer):
        asyncio.run(this.documents("elsewhere"))
    assert this.answer(REQUEST).response.answer and docs.removed == []
    assert asyncio.run(this.remove(["d2"])).documents == ["d2"]


def test_the_key_comes_from_the_caller_else_the_environment() -> None:
    assert api_key_from({"SELFRAG_API_KEY": " a "}) == "a"
    assert api_key_from({"SELFRAG_API_KEYS": " , b,c"}) == "b"
    assert api_key_from({"SELFRAG_API_KEY": "a", "SELFRAG_API_KEYS": "b"}) == "a"
    assert api_key_from({}) is None


def test_selfrag_open_with_a_url_answers_through_the_server(served, tmp_path: Path) -> None:
    url, service, _ = served
    with SelfRAG.open(url=url, api_key=KEY) as rag:
        assert rag.url == url
        r = rag.answer("Who founded Normandy?", top_k=2)
        assert r == scripted_response("Who founded Normandy?", DecodingConfig(top_k=2))
        assert [e.index for e in rag.stream("Who?")] == [0, 1]
        assert [p.id for p in rag.retrieve("Who?")] == ["p1"]
        assert rag.count() == 3 and [d.id for d in rag.documents()] == ["d1", "d2"]
        assert rag.health().served == SERVED
        with pytest.raises(ServedElsewhere, match=url):
            rag.index(tmp_path)
    with pytest.raises(TypeError, match="settings"):
        SelfRAG.open(url=url, model={"n_threads": 1})
    # Naming a home: its id travels with every request, and this server serves another.
    with SelfRAG.open(url=url, api_key=KEY, home=tmp_path / "b") as rag, pytest.raises(WrongServer):
        rag.answer("Who founded Normandy?")
    assert [r.question for r in service.seen] == ["Who founded Normandy?", "Who?"]


def test_the_framework_adapters_work_through_a_server(served) -> None:
    """The LangChain retriever (over `/v1/retrieve`), chat model and runnable, and the
    LlamaIndex query engine, each holding `SelfRAG.open(url=...)`: the server's results."""
    from langchain_core.messages import HumanMessage

    from selfrag.integrations.langchain import SelfRAGChatModel, SelfRAGRetriever, SelfRAGRunnable
    from selfrag.integrations.llamaindex import SelfRAGQueryEngine

    url, service, _ = served
    expected = scripted_response("Who founded Normandy?", DecodingConfig(top_k=2))
    with SelfRAG.open(url=url, api_key=KEY) as rag:
        [doc] = SelfRAGRetriever(rag=rag, top_k=1).invoke("Who?")
        assert (doc.id, doc.metadata["s_rel"]) == ("p1", 0.9)
        assert service.retrieved[-1] == RetrieveRequest(query="Who?", top_k=1)
        assert service.seen == []  # retrieval drafts nothing
        chat = SelfRAGChatModel(rag=rag, dials={"top_k": 2})
        message = chat.invoke([HumanMessage("Who founded Normandy?")])
        assert message.content == expected.answer
        output = SelfRAGRunnable(rag, top_k=2).invoke("Who founded Normandy?")
        assert output["response"] == expected
        engine = SelfRAGQueryEngine(answerer=rag, dials={"top_k": 2})
        assert str(engine.query("Who founded Normandy?")) == expected.answer
    assert [r.question for r in service.seen] == ["Who founded Normandy?"] * 3
