"""`runtime.answer_client`: the in-process answer client on fakes, alone and behind the HTTP
app, which then answers without Ray Serve (and counts its answers in `/metrics`)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi.testclient import TestClient

from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.routes import build_http_app, build_local_http_app
from selfrag.pipeline.decoder import BeamDecoder, StepListener
from selfrag.pipeline.protocols import Passage
from selfrag.pipeline.ranking import Hypothesis
from selfrag.runtime.answer_client import AnswerSite, LocalAnswerClient, query_cache_ready
from selfrag.runtime.answering import AnswerPath, CacheIdentity, Deadline
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import Cancelled, DeadlineExceeded
from tests.fakes import ListRetriever, ScriptedCritic
from tests.http_fakes import metric_value

# Sub-second deadlines raced against threads and timers: not for a CPU-starved process.
pytestmark = pytest.mark.deadline

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


class CountingCache(DictCache):
    """A cache with tier counters, as `infra.cache.tiers` keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.tiers = {"memory_hits": 0, "memory_misses": 0}

    def get(self, key: str) -> AnswerResponse | None:
        hit = super().get(key)
        self.tiers["memory_hits" if hit is not None else "memory_misses"] += 1
        return hit

    def counters(self) -> dict[str, int]:
        return dict(self.tiers)


class Home:
    """Two collections of a home on fakes: each its own passages, one decoder each."""

    def __init__(self) -> None:
        self.critic = ScriptedCritic(drafts={"p1": (" Rollo founded it.", -1.0, "eos")})
        self.cache = CountingCache()
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


def test_the_in_process_apps_metrics_count_its_answers() -> None:
    home = Home()
    client = LocalAnswerClient(home.site, probes={"model": lambda: True, "store": lambda: True})
    http = TestClient(build_local_http_app(client))

    def value(name: str, **labels: str) -> float:
        return metric_value(http.get("/metrics").text, name, **labels)

    assert value("selfrag_answers_total") == 0.0
    body = {"question": "Who founded Normandy?", "config": OPEN}
    assert http.post("/v1/answer", json=body).headers["X-Cache"] == "miss"
    assert http.post("/v1/answer", json=body).headers["X-Cache"] == "hit"
    text = http.get("/metrics").text
    assert metric_value(text, "selfrag_answers_total") == 1.0  # the hit decoded nothing
    assert metric_value(text, "selfrag_decoding_steps_total") >= 1.0
    assert metric_value(text, "selfrag_retrievals_total") >= 1.0
    assert metric_value(text, "selfrag_branches_total", outcome="opened") >= 1.0
    assert metric_value(text, "selfrag_query_cache_total", outcome="miss") == 1.0
    assert metric_value(text, "selfrag_query_cache_total", outcome="hit") == 1.0
    assert metric_value(text, "selfrag_query_cache_tier_total", event="memory_hits") == 1.0
    assert metric_value(text, "selfrag_inflight_answers") == 0.0
    ok = {"method": "POST", "path": "/v1/answer", "status": "200"}
    assert metric_value(text, "selfrag_http_requests_total", **ok) == 2.0
    assert metric_value(text, "selfrag_http_request_duration_seconds_count", path="/v1/answer") == 2

    with http.stream("POST", "/v1/answer/stream", json={**body, "question": "Who was Rollo?"}) as s:
        assert [line for line in s.iter_lines() if line == "event: answer"]
    assert value("selfrag_answers_total") == 2.0


def test_the_in_process_apps_metrics_count_a_deadline_and_answers_in_flight() -> None:
    slow = SlowSite()
    started = threading.Event()
    client = LocalAnswerClient(slow.site)
    http = TestClient(build_local_http_app(client))

    def answer() -> None:
        started.set()
        body = {"question": "Slow?", "config": {"timeout_s": 0.3}}
        assert http.post("/v1/answer", json=body).status_code == 504

    waiting = threading.Thread(target=answer)
    waiting.start()
    assert started.wait(2.0)
    time.sleep(0.1)
    assert metric_value(http.get("/metrics").text, "selfrag_inflight_answers") == 1.0
    waiting.join(5.0)
    assert slow.done.wait(2.0)
    time.sleep(0.05)  # the decode thread leaves the in-flight count as it ends
    text = http.get("/metrics").text
    assert metric_value(text, "selfrag_rejected_total", reason="deadline") == 1.0
    assert metric_value(text, "selfrag_inflight_answers") == 0.0
    assert metric_value(text, "selfrag_answers_total") == 0.0


def test_stop_cancels_the_answers_in_flight_and_waits_for_them() -> None:
    slow = SlowSite()
    client = LocalAnswerClient(slow.site)
    failures: list[BaseException] = []

    def answer() -> None:
        try:
            client.answer(AnswerRequest(question="Slow?"))
        except BaseException as exc:
            failures.append(exc)

    waiting = threading.Thread(target=answer)
    waiting.start()
    time.sleep(0.1)
    assert client.stop(2.0)
    waiting.join(2.0)
    assert slow.done.is_set() and isinstance(slow.ended, Cancelled) and slow.steps < 50
    assert [type(f) for f in failures] == [Cancelled]


def test_readiness_fails_a_probe_that_raises() -> None:
    def down() -> bool:
        raise ConnectionError("store down")

    client = LocalAnswerClient(Home().site, probes={"model": lambda: True, "store": down})
    checks = asyncio.run(client.health()).checks
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
        task = asyncio.create_task(client.aanswer(AnswerRequest(question="Slow?")))
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
        asyncio.run(client.aanswer(request))
    assert slow.done.wait(2.0)
    assert isinstance(slow.ended, DeadlineExceeded)


class _Counted:
    """`AnswerEvents` that keep what they were told."""

    def __init__(self) -> None:
        self.deadlines = 0

    def count_cache(self, event: str) -> None:
        pass

    def count_deadline(self) -> None:
        self.deadlines += 1


def test_a_paths_deadline_is_counted_once_whoever_sees_it_expire() -> None:
    events = _Counted()
    path = AnswerPath(DecodingConfig(), events=events)
    late = path.deadline(0.0)
    with pytest.raises(DeadlineExceeded):
        late.check()  # the decode sees it first
    late.expire()  # then the caller's timer
    with pytest.raises(DeadlineExceeded):
        late.check()
    assert events.deadlines == 1

    def too_slow(*_: object) -> AnswerResponse:
        raise DeadlineExceeded("a remote call ran out of time")

    timed = path.deadline(30.0)
    timed.expire()  # the caller's timer first, then the decode ends on it
    with pytest.raises(DeadlineExceeded):
        path.run("q", DecodingConfig(), too_slow, deadline=timed)
    assert events.deadlines == 2
    path.deadline(30.0).cancel()  # an abandoned answer is no deadline
    assert events.deadlines == 2


def test_a_run_whose_decode_ends_unaware_of_its_timeout_counts_the_deadline() -> None:
    """The loop's timer ends the run; the decode then returns without another check: the
    timed-out request is still counted, once."""
    finished = threading.Event()

    def unaware(
        question: str, config: DecodingConfig, _d: Deadline, on_step: StepListener | None
    ) -> AnswerResponse:
        time.sleep(0.4)
        finished.set()
        return Home().site(None).decode(question, config, _d, None)

    metrics = Metrics()
    path = AnswerPath(DecodingConfig(), facts=Facts())
    client = LocalAnswerClient(lambda _: AnswerSite(path, unaware), events=metrics)
    request = AnswerRequest.model_validate({"question": "Slow?", "config": {"timeout_s": 0.2}})
    with pytest.raises(DeadlineExceeded):
        asyncio.run(client.aanswer(request))
    assert finished.wait(2.0)
    assert metric_value(metrics.render(), "selfrag_rejected_total", reason="deadline") == 1.0


def test_query_cache_ready_pings_when_it_can() -> None:
    class Pinged(DictCache):
        def __init__(self, up: bool) -> None:
            super().__init__()
            self.up = up

        def ping(self) -> bool:
            return self.up

    assert query_cache_ready(None) and query_cache_ready(DictCache())
    assert query_cache_ready(Pinged(True)) and not query_cache_ready(Pinged(False))
    assert asyncio.run(LocalAnswerClient(Home().site).health()).checks == {"cache": True}
