"""`runtime.answer_stream`: an answer client's segments as they are decoded, blocking and for
asyncio, and a client's coroutine run from blocking code, over scripted clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from selfrag.runtime.answer_stream import SegmentStream, run_blocking
from selfrag.schemas.answer import AnswerRequest
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import Cancelled, Overloaded
from selfrag.schemas.events import SegmentEvent
from tests.http_fakes import FakeService, HangingService

REQUEST = AnswerRequest(question="Who founded Normandy?")


def test_iterating_yields_each_steps_segments_then_keeps_the_response() -> None:
    client = FakeService()
    stream = SegmentStream(client.aanswer, REQUEST)
    events = list(stream)
    assert all(isinstance(e, SegmentEvent) for e in events)
    assert [e.index for e in events] == [0, 1]
    assert stream.response is not None and stream.response.answer == "Rollo founded it. In 911."
    assert [r.question for r in client.seen] == [REQUEST.question]


def test_async_iteration_runs_on_the_callers_loop() -> None:
    config = DecodingConfig(top_k=2)
    client = FakeService()
    stream = SegmentStream(client.aanswer, REQUEST, config)

    async def collect() -> list[int]:
        return [e.index async for e in stream]

    assert asyncio.run(collect()) == [0, 1]
    assert stream.response is not None and client.configs_given == [config]


def test_a_failure_is_raised_to_the_reader() -> None:
    with pytest.raises(Overloaded):
        list(SegmentStream(FakeService(fail=Overloaded("busy")).aanswer, REQUEST))

    async def read() -> None:
        async for _ in SegmentStream(FakeService(fail=Overloaded("busy")).aanswer, REQUEST):
            pass

    with pytest.raises(Overloaded):
        asyncio.run(read())


def test_leaving_early_cancels_the_answer() -> None:
    client = HangingService()
    stream = SegmentStream(client.aanswer, REQUEST)
    for event in stream:
        assert event.index == 0
        break
    assert client.cancelled.wait(2.0)
    stream.join(2.0)

    client = HangingService()

    async def leave() -> None:
        events: AsyncIterator[SegmentEvent] = aiter(SegmentStream(client.aanswer, REQUEST))
        assert (await anext(events)).index == 0
        await events.aclose()  # type: ignore[attr-defined]

    asyncio.run(leave())
    assert client.cancelled.is_set()


def test_a_stream_stopped_before_it_starts_is_cancelled() -> None:
    stream = SegmentStream(FakeService().aanswer, REQUEST)
    stream.stop()
    with pytest.raises(Cancelled):
        list(stream)


def test_run_blocking_works_inside_a_running_loop() -> None:
    async def answer() -> str:
        return (await FakeService().aanswer(REQUEST)).response.answer

    async def inside() -> str:
        return run_blocking(answer)

    assert run_blocking(answer) == "Rollo founded it. In 911."
    assert asyncio.run(inside()) == "Rollo founded it. In 911."


def test_run_blocking_raises_what_the_coroutine_raises_inside_a_running_loop() -> None:
    async def fail() -> None:
        await FakeService(fail=Overloaded("busy")).aanswer(REQUEST)

    async def inside() -> None:
        run_blocking(fail)

    with pytest.raises(Overloaded):
        run_blocking(fail)
    with pytest.raises(Overloaded):
        asyncio.run(inside())


def test_a_clients_blocking_twins_and_stream_come_from_its_async_methods() -> None:
    client = FakeService()
    assert client.answer(REQUEST).response.answer == "Rollo founded it. In 911."
    assert client.config(REQUEST) == DecodingConfig()
    stream = client.stream(REQUEST, DecodingConfig(top_k=2))
    assert [e.index for e in stream] == [0, 1]
    assert client.configs_given[-1] == DecodingConfig(top_k=2)
