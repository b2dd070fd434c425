"""A scripted answer service for the HTTP layer's tests (and one that hangs until cancelled),
`live_server` (an app under a real uvicorn socket) and `metric_value` (one sample of a
`/metrics` text); shared by tests/actors/http/, tests/runtime/ and tests/integrations/."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from selfrag.actors.http.metrics import Metrics
from selfrag.pipeline.decoder import StepListener
from selfrag.pipeline.ranking import Hypothesis
from selfrag.runtime.answer_client import AnswerClientBase
from selfrag.runtime.answering import Answer
from selfrag.schemas.answer import (
    AnswerRequest,
    AnswerResponse,
    Citation,
    PassageOut,
    SegmentOut,
    Usage,
)
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.health import Health, ServedIndex
from selfrag.schemas.retrieval import RankedPassage, RetrieveRequest
from tests.redis_proc import free_port

SERVED = ServedIndex(home_id="0" * 32, collection="passages")
"""What `FakeService` says it serves."""


def _segment(text: str, pid: str | None) -> SegmentOut:
    return SegmentOut(
        text=text,
        citation=Citation(passage_id=pid, title="T") if pid else None,
        retrieved=pid is not None,
        p_ret=0.8,
        s_rel=0.9 if pid else None,
        s_sup=0.75 if pid else None,
        s_use=0.5,
        is_sup="full" if pid else None,
        logprob=-1.5,
        n_tokens=4,
        score=1.2,
    )


def scripted_response(question: str, config: DecodingConfig) -> AnswerResponse:
    """Two segments, the first citing passage p1, the second citing nothing."""
    segs = [_segment(" Rollo founded it.", "p1"), _segment(" In 911.", None)]
    return AnswerResponse(
        question=question,
        answer="".join(s.text for s in segs).strip(),
        abstained=False,
        segments=segs,
        passages=[PassageOut(id="p1", title="T", text="Rollo founded Normandy.", score=0.9)],
        usage=Usage(
            steps=2, retrievals=1, branches_opened=5, branches_pruned=1, branches_filtered=1
        ),
        timings_ms={"total": 12.0},
        model_id="fake",
        critique="prompted",
        config=config,
    )


@dataclass
class FakeService(AnswerClientBase):
    """Answers from a script after `delay_s`; `fail` raises instead; records the requests
    it saw. `ready_error` makes the readiness check itself fail. Retrieves passage p1 (and
    records the request)."""

    fail: Exception | None = None
    delay_s: float = 0.0
    ready: dict[str, bool] = field(
        default_factory=lambda: {"model": True, "store": True, "cache": True}
    )
    ready_error: Exception | None = None
    seen: list[AnswerRequest] = field(default_factory=list)
    configs_given: list[DecodingConfig | None] = field(default_factory=list)
    """The `config` each `run` was handed (None: the service works it out)."""
    metrics: Metrics | None = None
    scrapes: int = 0
    script: Callable[[str, DecodingConfig], AnswerResponse] = scripted_response
    """What the answer is (its segments are also the steps streamed)."""
    served: ServedIndex | None = SERVED
    retrieved: list[RetrieveRequest] = field(default_factory=list)

    async def aconfig(self, request: AnswerRequest) -> DecodingConfig:
        config = request.config.apply_to(DecodingConfig())
        return config if request.max_tokens is None else config.within_tokens(request.max_tokens)

    async def aretrieve(self, request: RetrieveRequest) -> list[RankedPassage]:
        self.retrieved.append(request)
        if self.fail is not None:
            raise self.fail
        s_rel = 0.9 if request.order == "relevance" else None
        passage = RankedPassage(id="p1", title="T", text="Rollo founded Normandy.", score=0.9)
        return [passage.model_copy(update={"s_rel": s_rel})]

    async def aanswer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer:
        self.seen.append(request)
        self.configs_given.append(config)
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        r = self.script(request.question, config or await self.aconfig(request))
        if on_step is not None:
            # Steps come from a worker thread in the real service.
            def steps() -> None:
                for leader in self.leaders(r.segments):
                    on_step(leader)

            await asyncio.to_thread(steps)
        if self.metrics is not None:
            self.metrics.observe_answer(r)
        return Answer(r, "miss")

    def leaders(self, segments: list[SegmentOut]) -> list[Hypothesis]:
        """The leading hypothesis at each step: the first segment, then the whole answer."""
        return [Hypothesis(segments=(segments[0],)), Hypothesis(segments=tuple(segments))]

    async def health(self) -> Health:
        if self.ready_error is not None:
            raise self.ready_error
        return Health.of(self.ready, self.served)

    async def collect_metrics(self) -> None:
        """Counts the scrapes: `/metrics` asks first."""
        self.scrapes += 1


class HangingService(FakeService):
    """Sends the first segment of its answer as a step, then waits until cancelled, which it
    records in `cancelled`."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = threading.Event()

    async def aanswer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer:
        self.seen.append(request)
        r = self.script(request.question, config or await self.aconfig(request))
        try:
            if on_step is not None:
                await asyncio.to_thread(on_step, Hypothesis(segments=(r.segments[0],)))
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("never cancelled")


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name{labels}` in a Prometheus exposition (KeyError if none)."""
    want = frozenset(labels.items())
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and frozenset(s.labels.items()) == want:
                return s.value
    raise KeyError(f"no sample {name}{dict(labels)}")


@contextmanager
def live_server(app: FastAPI) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port, in a thread: real sockets, so a client
    can really go away. Yields the base URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
