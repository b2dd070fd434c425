"""actors/service.py without Ray: deployment handles replaced by in-process stand-ins around
the scripted critic, to check the cache hook, the in-flight limit and the deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from actors.http import DeadlineExceeded, DependencyDown, Overloaded, Unprocessable
from actors.metrics import BatchStats, Metrics
from actors.service import ServeAnswerService, as_service_error, query_key
from pipeline.protocols import Passage
from pipeline.ranking import rank_step
from schemas.answer import AnswerRequest, AnswerResponse
from schemas.decoding import DecodingConfig
from tests.fakes import ListRetriever, ScriptedCritic


class _Response:
    """Stands in for a DeploymentResponse: `.result()` from threads, `await` in the loop."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn

    def result(self) -> Any:
        return self._fn()

    def __await__(self):  # type: ignore[no-untyped-def]
        async def run() -> Any:
            # A remote call does not block the caller's event loop.
            return await asyncio.to_thread(self._fn)

        return run().__await__()


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> _Response:
        return _Response(lambda: self._fn(*args))


class Handle:
    """Routes `handle.name.remote(...)` to `target.name(...)` in process."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name))


class Pool:
    def __init__(self, critic: ScriptedCritic, delay_s: float = 0.0) -> None:
        self.critic = critic
        self.delay_s = delay_s

    def model_id(self) -> str:
        return "scripted-model"

    def critic_name(self, source: str) -> str:
        if source == "native":
            raise ValueError("critique 'native' needs a Self-RAG checkpoint")
        return self.critic.name

    def ready(self) -> bool:
        return True

    def stats(self) -> BatchStats:
        return BatchStats()

    def relevance(self, source, branches):  # type: ignore[no-untyped-def]
        return self.critic.relevance(branches)

    def draft(self, source, branches, max_tokens):  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        return self.critic.draft(branches, max_tokens)

    def support(self, source, branches, drafts):  # type: ignore[no-untyped-def]
        return self.critic.support(branches, drafts)

    def utility(self, source, branches, drafts):  # type: ignore[no-untyped-def]
        return self.critic.utility(branches, drafts)


class Decider:
    def __init__(self, critic: ScriptedCritic) -> None:
        self.critic = critic

    def decide(self, source, branches):  # type: ignore[no-untyped-def]
        return self.critic.retrieval(branches)


class Store(ListRetriever):
    def __init__(self, passages: list[Passage], delay_s: float = 0.0) -> None:
        super().__init__(passages)
        self.delay_s = delay_s
        self.version_calls = 0

    def index_version(self) -> str:
        self.version_calls += 1
        time.sleep(self.delay_s)
        return "v1"

    def ready(self) -> bool:
        return True


class Ranker:
    def rank(self, beam, live, drafted, cfg):  # type: ignore[no-untyped-def]
        return rank_step(beam, live, drafted, cfg)


class DictCache:
    def __init__(self, broken: bool = False) -> None:
        self.data: dict[str, AnswerResponse] = {}
        self.broken = broken

    def get(self, key: str) -> AnswerResponse | None:
        if self.broken:
            raise ConnectionError("redis down")
        return self.data.get(key)

    def put(self, key: str, response: AnswerResponse) -> None:
        if self.broken:
            raise ConnectionError("redis down")
        self.data[key] = response


def _service(
    *,
    cache: DictCache | None = None,
    delay_s: float = 0.0,
    max_inflight: int = 4,
    store: Store | None = None,
    index_version_ttl_s: float = 0.0,
) -> tuple[ServeAnswerService, Metrics]:
    critic = ScriptedCritic(relevance_of={"p1": 0.9})
    metrics = Metrics()
    store = store or Store([Passage("p1", "Rollo founded Normandy.", "Normans")])
    service = ServeAnswerService(
        pool=Handle(Pool(critic, delay_s)),  # type: ignore[arg-type]
        decider=Handle(Decider(critic)),  # type: ignore[arg-type]
        retriever=Handle(store),  # type: ignore[arg-type]
        ranker=Handle(Ranker()),  # type: ignore[arg-type]
        defaults=DecodingConfig(max_segments=1),
        max_inflight=max_inflight,
        metrics=metrics,
        cache=cache,
        index_version_ttl_s=index_version_ttl_s,
    )
    return service, metrics


REQUEST = AnswerRequest(question="Who founded Normandy?", config={"mode": "always"})


def test_answers_through_the_handles_with_the_pipeline_decoder():
    service, metrics = _service()
    answer = asyncio.run(service.answer(REQUEST))
    assert answer.cache == "off"
    r = answer.response
    assert r.model_id == "scripted-model" and r.critique == "scripted"
    assert r.segments[0].citation is not None and r.segments[0].citation.passage_id == "p1"
    assert "selfrag_answers_total 1" in metrics.render()


def test_repeated_query_is_a_cache_hit_and_the_key_covers_config():
    cache = DictCache()
    service, metrics = _service(cache=cache)

    async def twice() -> tuple:
        return await service.answer(REQUEST), await service.answer(REQUEST)

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


@pytest.mark.parametrize(("ttl_s", "calls"), [(0.0, 3), (60.0, 1)])
def test_the_index_version_is_asked_again_only_after_its_ttl(ttl_s: float, calls: int):
    store = Store([Passage("p1", "Rollo founded Normandy.", "Normans")])
    service, _ = _service(cache=DictCache(), store=store, index_version_ttl_s=ttl_s)

    async def thrice() -> list[str]:
        return [(await service.answer(REQUEST)).cache for _ in range(3)]

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
            await service.answer(slow)
        return time.perf_counter() - t0

    assert asyncio.run(run()) < 0.9
    assert 'selfrag_rejected_total{reason="deadline"} 1' in metrics.render()


def test_a_broken_cache_is_bypassed_and_counted():
    service, metrics = _service(cache=DictCache(broken=True))
    answer = asyncio.run(service.answer(REQUEST))
    assert answer.cache == "error" and answer.response.answer
    assert 'selfrag_query_cache_total{outcome="error"} 2' in metrics.render()
    assert asyncio.run(service.readiness())["cache"] is False


def test_past_the_deadline_is_504_and_frees_its_slot_when_the_thread_ends():
    service, metrics = _service(delay_s=0.5, max_inflight=1)
    slow = AnswerRequest(question="q", config={"mode": "never", "timeout_s": 0.1})

    async def run() -> None:
        with pytest.raises(DeadlineExceeded):
            await service.answer(slow)
        # The decoder thread still runs: the slot stays taken until it ends.
        with pytest.raises(Overloaded):
            await service.answer(slow)
        await asyncio.sleep(0.8)
        assert (await service.answer(AnswerRequest(question="q"))).response.answer

    asyncio.run(run())
    assert 'selfrag_rejected_total{reason="deadline"} 1' in metrics.render()


def test_over_the_inflight_limit_is_503():
    service, _ = _service(delay_s=0.3, max_inflight=1)
    req = AnswerRequest(question="q", config={"mode": "never"})

    async def run() -> list[Any]:
        return await asyncio.gather(
            service.answer(req), service.answer(req), return_exceptions=True
        )

    first, second = asyncio.run(run())
    assert first.response.answer
    assert isinstance(second, Overloaded)


def test_an_unusable_critique_source_is_422():
    service, _ = _service()
    with pytest.raises(Unprocessable, match="native"):
        asyncio.run(service.answer(AnswerRequest(question="q", config={"critique": "native"})))


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
    critic = ScriptedCritic(relevance_of={"p1": 0.9})
    store = FlakyStore([Passage("p1", "Rollo founded Normandy.", "Normans")])
    service = ServeAnswerService(
        pool=Handle(Pool(critic)),  # type: ignore[arg-type]
        decider=Handle(Decider(critic)),  # type: ignore[arg-type]
        retriever=Handle(store),  # type: ignore[arg-type]
        ranker=Handle(Ranker()),  # type: ignore[arg-type]
        defaults=DecodingConfig(max_segments=1),
        max_inflight=4,
        metrics=Metrics(),
    )

    async def run() -> None:
        store.down = True
        with pytest.raises(DependencyDown, match="passage store"):
            await service.answer(REQUEST)
        assert (await service.readiness())["store"] is False
        store.down = False
        assert (await service.readiness())["store"] is True
        assert (await service.answer(REQUEST)).response.segments[0].citation is not None

    asyncio.run(run())


def test_a_full_deployment_queue_is_503_overloaded():
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    mapped = as_service_error(BackPressureError(num_queued_requests=64, max_queued_requests=64))
    assert isinstance(mapped, Overloaded)
    assert isinstance(as_service_error(ActorDiedError()), DependencyDown)


def test_timeout_above_the_server_maximum_is_422():
    critic = ScriptedCritic(relevance_of={"p1": 0.9})
    service = ServeAnswerService(
        pool=Handle(Pool(critic)),  # type: ignore[arg-type]
        decider=Handle(Decider(critic)),  # type: ignore[arg-type]
        retriever=Handle(Store([])),  # type: ignore[arg-type]
        ranker=Handle(Ranker()),  # type: ignore[arg-type]
        defaults=DecodingConfig(max_segments=1),
        max_inflight=4,
        metrics=Metrics(),
        max_timeout_s=30.0,
    )
    with pytest.raises(Unprocessable, match="max_timeout_s"):
        asyncio.run(service.answer(AnswerRequest(question="q", config={"timeout_s": 60})))
    assert asyncio.run(service.answer(AnswerRequest(question="q", config={"timeout_s": 30})))
