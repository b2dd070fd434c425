"""`runtime.answer_client`: the in-process answer client on fakes, alone and behind the HTTP
app, which then answers without Ray Serve."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi.testclient import TestClient

from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.routes import build_http_app
from selfrag.pipeline.decoder import BeamDecoder, StepListener
from selfrag.pipeline.protocols import Passage
from selfrag.pipeline.ranking import Hypothesis
from selfrag.runtime.answer_client import AnswerSite, LocalAnswerClient, query_cache_ready
from selfrag.runtime.answering import AnswerPath, CacheIdentity, Deadline
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import Cancelled, DeadlineExceeded
from tests.fakes import ListRetriever, ScriptedCritic

OPEN = {"mode": "always", "top_k": 1, "min_relevance": 0.0, "min_support_score": 0.0}


class Facts:
    """`CritiqueFacts`: `auto` is `learned` here, with a calibrated support threshold."""

    def critique_name(self, source: str) -> str:
        return "learned" if source == "auto" else source

    def calibrated_filters(self, name: str) -> dict[str, object]:
        return {"min_support_score": 0.25} if name == "learned" else {}


class DictCache:
    def __init__(self) -> None:
        self.entries: dict[str, AnswerResponse] = {}

    def get(self, key: str) -> AnswerResponse | None:
        return self.entries.get(key)

    def put(self, key: str, response: AnswerResponse) -> None:
        self.entries[key] = response


class Home:
    """Two collections of a home on fakes: each its own passages, one decoder each."""

    def __init__(self) -> None:
        self.critic = ScriptedCritic(drafts={"p1": (" Rollo founded it.", -1.0, "eos")})
        self.cache = DictCache()
        self.passages = {
            "main": [Passage("p1", "Rollo founded Normandy in France.", "Normans")],
            "other": [Passage("p9", "Paris is in France.", "France")],
        }
        self.decoded: list[tuple[str, str, DecodingConfig]] = []

    def site(self, collection: str | None) -> AnswerSite:
        name = collection or "main"
        retriever = ListRetriever(self.passages[name])
        decoder = BeamDecoder(lambda _source: self.critic, retriever, "fake")

        def decode(
            question: str, config: DecodingConfig, _d: Deadline, on_step: StepListener | None
        ) -> AnswerResponse:
            self.decoded.append((name, question, config))
            return decoder.answer(question, config, on_step)

        path = AnswerPath(DecodingConfig(), facts=Facts(), cache=self.cache)
        return AnswerSite(path, decode, lambda: CacheIdentity(f"index-{name}", "fake-model"))


def test_answer_settles_the_request_once_and_caches_it() -> None:
    home = Home()
    client = LocalAnswerClient(home.site)
    request = AnswerRequest.model_validate({"question": "Who founded Normandy?", "config": OPEN})
    config = client.config(request)
    # Settled: `auto` resolved; the calibrated threshold fills only what the request left unset.
    assert config.critique == "learned" and config.min_support_score == 0.0
    unset = AnswerRequest.model_validate({"question": "Who?", "config": {"mode": "always"}})
    assert client.config(unset).min_support_score == 0.25
    first = client.answer(request, config=config)
    assert first.cache == "miss" and "Rollo" in first.response.answer
    assert client.answer(request).cache == "hit"
    assert [(c, q) for c, q, _ in home.decoded] == [("main", "Who founded Normandy?")]
    assert home.decoded[0][2] == config
    other = AnswerRequest.model_validate(
        {"question": "Who founded Normandy?", "config": OPEN, "collection": "other"}
    )
    assert client.answer(other).response.passages[0].id == "p9"  # another collection's key


def test_http_app_answers_in_process_without_serve() -> None:
    home = Home()
    client = LocalAnswerClient(home.site, probes={"model": lambda: True, "store": lambda: True})
    http = TestClient(build_http_app(client, Metrics()))
    body = {"question": "Who founded Normandy?", "config": OPEN}

    r = http.post("/v1/answer", json=body)
    assert r.status_code == 200, r.text
    assert "Rollo" in r.json()["answer"] and r.json()["config"]["critique"] == "learned"
    assert r.headers["X-Cache"] == "miss"
    assert http.post("/v1/answer", json=body).headers["X-Cache"] == "hit"

    with http.stream("POST", "/v1/answer/stream", json={**body, "question": "Who was Rollo?"}) as s:
        events = [line.split(": ", 1)[1] for line in s.iter_lines() if line.startswith("event:")]
    assert events[0] == "segment" and events[-1] == "answer"

    chat = http.post(
        "/v1/chat/completions",
        json={"model": "selfrag", "messages": [{"role": "user", "content": "Who was Rollo?"}]},
    )
    assert chat.status_code == 200 and "Rollo" in chat.json()["choices"][0]["message"]["content"]

    ready = http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"model": True, "store": True, "cache": True}

    bad = http.post("/v1/answer", json={**body, "config": {"critique": "nonsense"}})
    assert bad.status_code == 422


def test_readiness_fails_a_probe_that_raises() -> None:
    def down() -> bool:
        raise ConnectionError("store down")

    client = LocalAnswerClient(Home().site, probes={"model": lambda: True, "store": down})
    checks = asyncio.run(client.readiness())
    assert checks == {"model": True, "store": False, "cache": True}


class SlowSite:
    """A decode of many slow steps, recording how it ended."""

    def __init__(self) -> None:
        self.ended: BaseException | None = None
        self.steps = 0
        self.done = threading.Event()

    def site(self, _collection: str | None) -> AnswerSite:
        return AnswerSite(AnswerPath(DecodingConfig(), facts=Facts()), self.decode)

    def decode(
        self, question: str, config: DecodingConfig, _d: Deadline, on_step: StepListener | None
    ) -> AnswerResponse:
        try:
            for _ in range(200):
                time.sleep(0.02)
                self.steps += 1
                if on_step is not None:
                    on_step(Hypothesis(segments=()))
            raise AssertionError("the decode was never stopped")
        except BaseException as exc:
            self.ended = exc
            raise
        finally:
            self.done.set()


def test_a_cancelled_run_stops_its_decode_at_the_next_step() -> None:
    slow = SlowSite()
    client = LocalAnswerClient(slow.site)

    async def cancel_soon() -> None:
        task = asyncio.create_task(client.run(AnswerRequest(question="Slow?")))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_soon())
    assert slow.done.wait(2.0)
    assert isinstance(slow.ended, Cancelled) and slow.steps < 50


def test_a_run_past_its_timeout_is_deadline_exceeded_and_stops() -> None:
    slow = SlowSite()
    client = LocalAnswerClient(slow.site)
    request = AnswerRequest.model_validate({"question": "Slow?", "config": {"timeout_s": 0.2}})
    with pytest.raises(DeadlineExceeded):
        asyncio.run(client.run(request))
    assert slow.done.wait(2.0)
    assert isinstance(slow.ended, DeadlineExceeded)


def test_query_cache_ready_pings_when_it_can() -> None:
    class Pinged(DictCache):
        def __init__(self, up: bool) -> None:
            super().__init__()
            self.up = up

        def ping(self) -> bool:
            return self.up

    assert query_cache_ready(None) and query_cache_ready(DictCache())
    assert query_cache_ready(Pinged(True)) and not query_cache_ready(Pinged(False))
    assert asyncio.run(LocalAnswerClient(Home().site).readiness()) == {"cache": True}
