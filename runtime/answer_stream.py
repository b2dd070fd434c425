"""One answer of any answer client as its segments are decoded, for callers that block or that
run an event loop (`AnswerClient.stream`, which the Python API and the framework adapters
use), and a coroutine run to its end from blocking code (`run_blocking`: the blocking twins of
a client's async methods)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar

from selfrag.pipeline.decoder import StepListener
from selfrag.pipeline.ranking import Hypothesis
from selfrag.runtime.answering import Answer, LeaderSegments
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import Cancelled
from selfrag.schemas.events import SegmentEvent

_END = object()
_T = TypeVar("_T")

AnswerCall = Callable[
    [AnswerRequest, StepListener | None, DecodingConfig | None], Awaitable[Answer]
]
"""An answer client's `aanswer`: the answer, its leading hypothesis after each step to
`on_step`."""


def run_blocking(work: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """`work()` run to its end on an event loop of its own, blocking this thread: here when
    this thread runs no loop, else in a thread of its own (a notebook's thread runs one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work())
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(asyncio.run(work()))
        except BaseException as exc:  # handed to the caller, which raises it
            box.append(exc)

    thread = threading.Thread(target=run, name="selfrag-blocking", daemon=True)
    thread.start()
    thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]  # type: ignore[no-any-return]


class SegmentStream:
    """The leading hypothesis's segments of one answer as a client decodes them
    (`SegmentEvent`: index i replaces any segment with index ≥ i seen before, since the beam's
    leader can change); the full answer is `response` once the iteration ends. Iterating blocks
    (the answer runs on an event loop in a thread of its own); `async for` runs it as a task on
    the running loop. Leaving the loop early, or `stop`, cancels the answer: its decode ends at
    its next step. Iterate a stream once."""

    def __init__(
        self, answer: AnswerCall, request: AnswerRequest, config: DecodingConfig | None = None
    ) -> None:
        """`answer`: the client's `aanswer`. `config`: the client's `config(request)`, when the
        caller has it."""
        self.response: AnswerResponse | None = None
        self._answer = answer
        self._request = request
        self._config = config
        self._leader = LeaderSegments()
        self._lock = threading.Lock()
        self._stopped = False
        self._task: asyncio.Task[Answer] | None = None
        self._thread: threading.Thread | None = None

    def stop(self) -> None:
        """Cancel the answer (from any thread), whether or not it started."""
        with self._lock:
            self._stopped = True
            task = self._task
        if task is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed: it ended
                task.get_loop().call_soon_threadsafe(task.cancel)

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a blocking iteration's thread to end."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _answer_task(self, on_step: StepListener) -> asyncio.Task[Answer]:
        """The answer as a task of the running loop; `Cancelled` once stopped."""
        with self._lock:
            if self._stopped:
                raise Cancelled("the stream was stopped")
            self._task = asyncio.ensure_future(self._answer(self._request, on_step, self._config))
            return self._task

    def __iter__(self) -> Generator[SegmentEvent, None, None]:
        items: queue.Queue[object] = queue.Queue()

        def on_step(h: Hypothesis) -> None:
            for event in self._leader.events(h):
                items.put(event)

        async def answer() -> Answer:
            return await self._answer_task(on_step)

        def work() -> None:
            try:
                items.put(asyncio.run(answer()))
            except BaseException as exc:  # handed to the reader, which raises it
                items.put(exc)
            finally:
                items.put(_END)

        self._thread = threading.Thread(target=work, name="selfrag-stream", daemon=True)
        self._thread.start()
        try:
            while (item := items.get()) is not _END:
                if (event := self._item(item)) is not None:
                    yield event
        finally:
            self.stop()

    async def __aiter__(self) -> AsyncGenerator[SegmentEvent, None]:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[object] = asyncio.Queue()

        def on_step(h: Hypothesis) -> None:  # from the decode's thread
            for event in self._leader.events(h):
                loop.call_soon_threadsafe(items.put_nowait, event)

        task = self._answer_task(on_step)
        # Put after any event still scheduled by call_soon_threadsafe.
        task.add_done_callback(lambda t: loop.call_soon(items.put_nowait, t))
        try:
            while (item := await items.get()) is not task:
                yield item  # type: ignore[misc]
            if task.cancelled():  # `stop` from elsewhere
                raise Cancelled("the stream was stopped")
            self._item(task.result())
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})  # its end, without raising its failure

    def _item(self, item: object) -> SegmentEvent | None:
        """A segment event to hand out; None for the answer, which is kept."""
        if isinstance(item, asyncio.CancelledError):  # `stop` from elsewhere
            raise Cancelled("the stream was stopped") from item
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Answer):
            self.response = item.response
            return None
        return item  # type: ignore[return-value]
