"""actors/http/service.py without Ray: deployment handles replaced by in-process stand-ins around
the scripted critic, to check the cache hook, the in-flight limit and the deadline."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.service import ServeAnswerService, as_service_error
from selfrag.pipeline.protocols import Passage
from selfrag.runtime import answering as answering_module
from selfrag.runtime.answering import query_cache_scope, query_key
from selfrag.schemas.answer import AnswerRequest
from selfrag.schemas.calibration import CalibrationSettings, LogisticParams
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import (
    Cancelled,
    DeadlineExceeded,
    DependencyDown,
    Overloaded,
    Unprocessable,
)
from selfrag.schemas.settings import RetrievalSettings, Settings
from tests.fakes import ScriptedCritic
from tests.http_fakes import metric_value
from tests.serve_fakes import Decider, DictCache, Pool, Rig, Store, make_service

# Sub-second deadlines raced against threads and timers: not for a CPU-starved process.
pytestmark = pytest.mark.deadline


def _service(
    *,
    cache: DictCache | None = None,
    delay_s: float = 0.0,
    max_inflight: int = 4,
    store: Store | None = None,
    index_version_ttl_s: float = 0.0,
) -> tuple[ServeAnswerService, Metrics]:
    rig = make_service(
        pool=Pool(ScriptedCritic(relevance_of={"p1": 0.9}), delay_s),
        store=store,
        cache=cache,
        max_inflight=max_inflight,
        index_version_ttl_s=index_version_ttl_s,
    )
    return rig.service, rig.metrics


REQUEST = AnswerRequest(question="Who founded Normandy?", config={"mode": "always"})


def test_answers_through_the_handles_with_the_pipeline_decoder():
    service, metrics = _service()
    answer = asyncio.run(service.aanswer(REQUEST))
    assert answer.cache == "off"
    r = answer.response
    assert r.model_id == "scripted-model" and r.critique == "scripted"
    assert r.segments[0].citation is not None and r.segments[0].citation.passage_id == "p1"
    assert "selfrag_answers_total 1" in metrics.render()


def test_each_step_makes_one_call_to_each_deployment_with_no_token_lists():
    service, metrics = _service()
    adaptive = AnswerRequest(
        question="Who founded Normandy?",
        config={"mode": "adaptive", "threshold": 0.0, "max_segments": 2},
    )
    r = asyncio.run(service.aanswer(adaptive)).response
    steps = r.usage.steps
    assert steps >= 1
    text = metrics.render()
    for method in ("decide", "search_many", "expand", "rank"):
        assert metric_value(text, "selfrag_remote_calls_total", target="?", method=method) == steps
    # The old route: relevance, draft, support and utility were four calls to the pool.
    for method in ("relevance", "draft", "support", "utility", "retrieval", "search"):
        assert f'method="{method}"' not in text
    sent = {"target": "?", "method": "rank", "direction": "sent"}
    assert metric_value(text, "selfrag_remote_bytes_total", **sent) > 0


@pytest.mark.parametrize("affinity", [True, False])
def test_an_answers_pool_calls_share_one_session_id_unless_affinity_is_off(affinity: bool):
    rig = make_service(affinity=affinity)
    asyncio.run(rig.service.aanswer(REQUEST))
    seen = getattr(rig.pool_handle, "__dict__", {}).get("options_seen")
    if affinity:
        assert seen is not None and len(seen["session_id"]) == 32
    else:
        assert seen is None


def test_repeated_query_is_a_cache_hit_and_the_key_covers_config():
    cache = DictCache()
    service, metrics = _service(cache=cache)

    async def twice() -> tuple:
        return await service.aanswer(REQUEST), await service.aanswer(REQUEST)

    first, second = asyncio.run(twice())
    assert (first.cache, second.cache) == ("miss", "hit")
    assert second.response == first.response
    text = metrics.render()
    assert 'selfrag_query_cache_total{outcome="hit"} 1' in text
    assert 'selfrag_query_cache_total{outcome="miss"} 1' in text
    cfg = DecodingConfig()
    base = query_key("Who founded  NORMANDY?", cfg, "v1", "m")
    assert base == query_key("who founded normandy?", cfg, "v1", "m")
    assert base != query_key("who founded normandy?", cfg, "v2", "m")
    assert base != query_key("who founded normandy?", DecodingConfig(top_k=4), "v1", "m")
    assert base != query_key("who founded normandy?", cfg, "v1", "other-model")


def _settings(**changes: Any) -> Settings:
    return Settings(home=Path("/nonexistent"), **changes)


def test_the_query_key_covers_the_model_file_settings_and_code_version(
    monkeypatch: pytest.MonkeyPatch,
):
    cfg = DecodingConfig()
    scope = query_cache_scope(_settings())
    base = query_key("q", cfg, "v1", "m.gguf sha256:aa", scope)
    assert base == query_key("q", cfg, "v1", "m.gguf sha256:aa", query_cache_scope(_settings()))
    refit = CalibrationSettings(relevance=LogisticParams(a=2.0, b=-1.0))
    variants = [
        query_key("q", cfg, "v1", "m.gguf sha256:bb", scope),  # same file name, new content
        *(
            query_key("q", cfg, "v1", "m.gguf sha256:aa", query_cache_scope(s))
            for s in (
                _settings(calibration=refit),
                _settings(retrieval=RetrievalSettings(hybrid=False)),
                _settings(
                    retrieval=RetrievalSettings(
                        fusion="rrf" if RetrievalSettings().fusion == "dbsf" else "dbsf"
                    )
                ),
                _settings(retrieval=RetrievalSettings(embedding_model="/models/e5")),
                _settings(retrieval=RetrievalSettings(collection="other")),
                _settings(retrieval=RetrievalSettings(passage_words=100)),
                _settings(retrieval=RetrievalSettings(passage_overlap_words=10)),
            )
        ),
    ]
    with monkeypatch.context() as m:
        m.setattr(answering_module, "QUERY_KEY_FORMAT", answering_module.QUERY_KEY_FORMAT + 1)
        variants.append(query_key("q", cfg, "v1", "m.gguf sha256:aa", scope))
    with monkeypatch.context() as m:
        m.setattr(answering_module, "package_version", lambda: "99.0")
        variants.append(query_key("q", cfg, "v1", "m.gguf sha256:aa", scope))
    assert base not in variants and len(set(variants)) == len(variants)
    # Secrets never reach the key's inputs.
    secret = _settings(retrieval=RetrievalSettings(qdrant_api_key="s3cret"))
    assert "s3cret" not in repr(query_cache_scope(secret))


def test_a_new_model_file_or_calibration_is_not_served_from_the_cache():
    """The same shared cache behind three ingress replicas: one sees a model file with new
    content under the same name, one a new calibration; neither gets the old answer."""
    cache = DictCache()
    req = AnswerRequest(question="q", config={"mode": "never"})

    def first_answer(fingerprint: str, settings: Settings) -> str:
        pool = Pool(ScriptedCritic())
        pool.fingerprint = fingerprint
        rig = make_service(pool=pool, cache=cache, settings=settings)
        return asyncio.run(rig.service.aanswer(req)).cache

    assert first_answer("m.gguf sha256:aa", _settings()) == "miss"
    assert first_answer("m.gguf sha256:aa", _settings()) == "hit"
    assert first_answer("m.gguf sha256:bb", _settings()) == "miss"
    refit = CalibrationSettings(support=LogisticParams(a=0.5, b=0.0))
    assert first_answer("m.gguf sha256:aa", _settings(calibration=refit)) == "miss"


@pytest.mark.parametrize(("ttl_s", "calls"), [(0.0, 3), (60.0, 1)])
def test_the_index_version_is_asked_again_only_after_its_ttl(ttl_s: float, calls: int):
    store = Store([Passage("p1", "Rollo founded Normandy.", "Normans")])
    service, _ = _service(cache=DictCache(), store=store, index_version_ttl_s=ttl_s)

    async def thrice() -> list[str]:
        return [(await service.aanswer(REQUEST)).cache for _ in range(3)]

    assert asyncio.run(thrice()) == ["miss", "hit", "hit"]
    assert store.version_calls == calls


def test_the_deadline_covers_the_calls_before_decoding():
    # The index version (part of the cache key) is read before decoding starts.
    store = Store([Passage("p1", "Rollo founded Normandy.", "Normans")], delay_s=1.0)
    service, metrics = _service(cache=DictCache(), store=store)
    slow = AnswerRequest(question="q", config={"mode": "never", "timeout_s": 0.1})

    async def run() -> float:
        t0 = time.perf_counter()
        with pytest.raises(DeadlineExceeded):
            await service.aanswer(slow)
        return time.perf_counter() - t0

    assert asyncio.run(run()) < 0.9
    assert 'selfrag_rejected_total{reason="deadline"} 1' in metrics.render()


def test_a_broken_cache_is_bypassed_and_counted():
    service, metrics = _service(cache=DictCache(broken=True))
    answer = asyncio.run(service.aanswer(REQUEST))
    assert answer.cache == "error" and answer.response.answer
    assert 'selfrag_query_cache_total{outcome="error"} 2' in metrics.render()
    assert asyncio.run(service.health()).checks["cache"] is False


def test_past_the_deadline_is_504_and_frees_its_slot_when_the_thread_ends():
    service, metrics = _service(max_inflight=1)
    slow = AnswerRequest(question="q", config={"mode": "never", "timeout_s": 0.1})

    def busy_listener(_: Any) -> None:
        time.sleep(0.5)  # work in the decoder thread that no remote-call deadline interrupts

    async def run() -> None:
        with pytest.raises(DeadlineExceeded):
            await service.aanswer(slow, busy_listener)
        # The decoder thread still runs: the slot stays taken until it ends.
        with pytest.raises(Overloaded):
            await service.aanswer(slow)
        assert service.inflight == 1
        await asyncio.sleep(0.8)
        assert service.inflight == 0
        assert (await service.aanswer(AnswerRequest(question="q"))).response.answer

    asyncio.run(run())
    assert 'selfrag_rejected_total{reason="deadline"} 1' in metrics.render()


async def _until_idle(service: ServeAnswerService, limit_s: float) -> float:
    """Seconds until no admitted answer is left (fails after `limit_s`)."""
    t0 = time.perf_counter()
    while service.inflight:
        assert time.perf_counter() - t0 < limit_s, f"{service.inflight} answers still in flight"
        await asyncio.sleep(0.02)
    return time.perf_counter() - t0


def test_a_hung_pool_call_frees_its_slot_at_the_deadline():
    """A pool replica that never answers: the decoder stops waiting at the request's
    deadline, cancels the call, and its slot is free again, though the call still hangs."""
    hang = threading.Event()
    rig = make_service(max_inflight=1)
    rig.pool.hang = hang
    req = AnswerRequest(question="q", config={"mode": "never", "timeout_s": 0.3})

    async def run() -> None:
        t0 = time.perf_counter()
        with pytest.raises(DeadlineExceeded):
            await rig.service.aanswer(req)
        assert time.perf_counter() - t0 < 0.6
        await _until_idle(rig.service, 0.5)
        assert rig.pool.drafts_started == 1 and not hang.is_set()  # the call still hangs
        drafts = [c for c in rig.pool_handle.calls if c.cancelled]
        assert len(drafts) == 1
        assert "selfrag_inflight_answers 0" in rig.metrics.render()

    try:
        asyncio.run(run())
    finally:
        hang.set()


def test_an_abandoned_request_stops_its_decoder_at_once():
    """The stream cancels its answer when the client goes away: the decoder thread stops
    waiting on its remote call (long before the deadline) and frees the slot."""
    hang = threading.Event()
    rig = make_service(max_inflight=1)
    rig.pool.hang = hang
    req = AnswerRequest(question="q", config={"mode": "never", "timeout_s": 30})

    async def run() -> None:
        task = asyncio.create_task(rig.service.aanswer(req))
        while rig.pool.drafts_started == 0:
            await asyncio.sleep(0.01)
        assert rig.service.inflight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _until_idle(rig.service, 1.0) < 1.0
        assert [c.cancelled for c in rig.pool_handle.calls if c.cancelled] == [True]

    try:
        asyncio.run(run())
    finally:
        hang.set()


def test_lookups_before_decoding_are_cancelled_at_the_deadline():
    store = Store([Passage("p1", "Rollo founded Normandy.", "Normans")], delay_s=1.0)
    rig = make_service(cache=DictCache(), store=store)
    slow = AnswerRequest(question="q", config={"mode": "never", "timeout_s": 0.1})

    async def run() -> None:
        with pytest.raises(DeadlineExceeded):
            await rig.service.aanswer(slow)

    asyncio.run(run())
    assert rig.service.inflight == 0
    assert store.version_calls == 1
    assert [c.cancelled for c in rig.store_handle.calls] == [True]


def _blocking_rig() -> tuple[Rig, threading.Event]:
    """A service with one slot whose pool call hangs until the event is set."""
    hang = threading.Event()
    rig = make_service(max_inflight=1)
    rig.pool.hang = hang
    return rig, hang


def test_a_deadline_both_the_timer_and_the_decoder_see_is_counted_once():
    """The loop's timer ends the request and the decoder thread, waiting on a hung pool call,
    then finds the deadline passed too: one timed-out request, one count."""
    rig, hang = _blocking_rig()
    req = AnswerRequest(question="q", config={"mode": "never", "timeout_s": 0.2})

    async def run() -> None:
        with pytest.raises(DeadlineExceeded):
            await rig.service.aanswer(req)
        await _until_idle(rig.service, 1.0)

    try:
        asyncio.run(run())
    finally:
        hang.set()
    text = rig.metrics.render()
    assert metric_value(text, "selfrag_rejected_total", reason="deadline") == 1.0


def _until_idle_blocking(service: ServeAnswerService, limit_s: float) -> None:
    t0 = time.perf_counter()
    while service.inflight and time.perf_counter() - t0 < limit_s:
        time.sleep(0.02)
    assert service.inflight == 0, "the slot was never given back"


def test_a_cancelled_blocking_answer_gives_its_slot_back():
    """A stream over the service runs its answer on a loop of its own, closed once the answer
    is cancelled; the decoder thread ends after it and still frees the slot."""
    rig, hang = _blocking_rig()
    stream = rig.service.stream(AnswerRequest(question="q", config={"mode": "never"}))
    failures: list[BaseException] = []

    def read() -> None:
        try:
            list(stream)
        except BaseException as exc:
            failures.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        while rig.pool.drafts_started == 0:
            time.sleep(0.01)
        assert rig.service.inflight == 1
        stream.stop()
        reader.join(5.0)
        stream.join(5.0)
        assert [type(f) for f in failures] == [Cancelled]
        _until_idle_blocking(rig.service, 2.0)
        assert metric_value(rig.metrics.render(), "selfrag_inflight_answers") == 0.0
    finally:
        hang.set()
    assert rig.service.answer(REQUEST).response.answer  # the one slot is free


def test_a_blocking_answer_past_its_deadline_gives_its_slot_back_and_counts_once():
    rig, hang = _blocking_rig()
    req = AnswerRequest(question="q", config={"mode": "never", "timeout_s": 0.2})
    try:
        with pytest.raises(DeadlineExceeded):
            rig.service.answer(req)
        _until_idle_blocking(rig.service, 2.0)
    finally:
        hang.set()
    text = rig.metrics.render()
    assert metric_value(text, "selfrag_rejected_total", reason="deadline") == 1.0
    assert metric_value(text, "selfrag_inflight_answers") == 0.0


def test_over_the_inflight_limit_is_503():
    service, _ = _service(delay_s=0.3, max_inflight=1)
    req = AnswerRequest(question="q", config={"mode": "never"})

    async def run() -> list[Any]:
        return await asyncio.gather(
            service.aanswer(req), service.aanswer(req), return_exceptions=True
        )

    first, second = asyncio.run(run())
    assert first.response.answer
    assert isinstance(second, Overloaded)


def test_an_unusable_critique_source_is_422():
    service, _ = _service()
    with pytest.raises(Unprocessable, match="native"):
        asyncio.run(service.aanswer(AnswerRequest(question="q", config={"critique": "native"})))


def test_only_a_critique_source_the_model_lacks_is_the_requests_fault():
    """The engine replicas build the critic a request names: a source this model cannot run
    is a 422 saying so; any other failure (here heads of another model file) is not the
    client's, and stays an exception (a 500 whose detail only the log has)."""
    from selfrag.actors.deployments import requested_critic
    from selfrag.pipeline.critics import CritiqueUnavailable
    from selfrag.pipeline.heads import HeadsError

    class Rag:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def critic(self, source: str) -> None:
            raise self.error

    lacking = Rag(CritiqueUnavailable("critique 'native' needs a Self-RAG checkpoint"))
    with pytest.raises(Unprocessable, match="needs a Self-RAG checkpoint"):
        requested_critic(lacking, "native")  # type: ignore[arg-type]
    broken = Rag(HeadsError("heads in /srv/home/heads/x.json are for another model file"))
    with pytest.raises(HeadsError):
        requested_critic(broken, "learned")  # type: ignore[arg-type]


class FlakyStore(Store):
    """A store that can be switched off, as a Qdrant server going away looks to the
    `Retriever` deployment: its search and probe raise (the deployment maps that to
    `DependencyDown`, which is what reaches the ingress)."""

    down = False

    def search(self, query: str, k: int) -> list[Passage]:
        if self.down:
            raise DependencyDown("the passage store does not answer: ConnectionRefusedError")
        return super().search(query, k)

    def ready(self) -> bool:
        return not self.down


def test_store_down_is_503_and_not_ready_then_recovers():
    store = FlakyStore([Passage("p1", "Rollo founded Normandy.", "Normans")])
    service = make_service(store=store).service

    async def run() -> None:
        store.down = True
        with pytest.raises(DependencyDown, match="passage store"):
            await service.aanswer(REQUEST)
        assert (await service.health()).checks["store"] is False
        store.down = False
        assert (await service.health()).checks["store"] is True
        assert (await service.aanswer(REQUEST)).response.segments[0].citation is not None

    asyncio.run(run())


def test_readiness_needs_the_deciders_engine_as_well_as_the_pools():
    decider = Decider(ScriptedCritic(relevance_of={"p1": 0.9}))
    service = make_service(decider=decider).service

    async def run() -> None:
        assert (await service.health()).checks["model"] is True
        decider.up = False  # an answer cannot be served: its first step asks the decider
        assert (await service.health()).checks["model"] is False
        decider.up = True
        assert (await service.health()).checks["model"] is True

    asyncio.run(run())


def test_a_full_deployment_queue_is_503_overloaded():
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    mapped = as_service_error(BackPressureError(num_queued_requests=64, max_queued_requests=64))
    assert isinstance(mapped, Overloaded)
    assert isinstance(as_service_error(ActorDiedError()), DependencyDown)


def test_timeout_above_the_server_maximum_is_422():
    service = make_service(store=Store([]), max_timeout_s=30.0).service
    with pytest.raises(Unprocessable, match="max_timeout_s"):
        asyncio.run(service.aanswer(AnswerRequest(question="q", config={"timeout_s": 60})))
    assert asyncio.run(service.aanswer(AnswerRequest(question="q", config={"timeout_s": 30})))


def test_a_drain_lets_the_answers_in_progress_end_and_refuses_new_ones_with_503():
    """A stop drains (`selfrag serve` calls `drain` until it says 0, within a grace period):
    an answer admitted before it ends with its response; one that comes after is a 503."""
    service, _ = _service(delay_s=0.3, max_inflight=4)
    req = AnswerRequest(question="q", config={"mode": "never"})

    async def run() -> tuple[Any, list[int], Any]:
        first = asyncio.ensure_future(service.aanswer(req))
        await asyncio.sleep(0.05)  # admitted, decoding
        counts = [service.drain()]
        late = await asyncio.gather(service.aanswer(req), return_exceptions=True)
        done = await first
        counts.append(service.drain())
        return done, counts, late[0]

    done, counts, late = asyncio.run(run())
    assert done.response.answer  # admitted before the drain: answered
    assert counts == [1, 0]
    assert isinstance(late, Overloaded) and "stopping" in str(late)
