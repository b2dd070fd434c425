"""A streamed answer over server-sent events, in any wire format: the decode runs as a task
whose steps become segment events, then the answer or an error; keep-alive comments while
idle; a client that disconnects cancels the decode. `/v1/answer/stream` (`NativeFormat`) and
the OpenAI-compatible endpoints (`actors/http/openai_routes.py`) share it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive

from selfrag.actors.http.metrics import Metrics
from selfrag.pipeline.ranking import Hypothesis
from selfrag.runtime.answer_client import AnswerClient
from selfrag.runtime.answering import LeaderSegments
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import AnswerError
from selfrag.schemas.events import ErrorEvent, SegmentEvent

log = logging.getLogger("selfrag.http")

KEEPALIVE_S = 10.0
"""A stream with no event for this long sends an SSE comment, so proxies keep it open."""
KEEPALIVE = b": keep-alive\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; only metrics see it
REQUEST_ID_SCOPE_KEY = "selfrag.request_id"
"""Where the app's outer layer (`actors/http/routes.py`) keeps the request id in the ASGI scope."""


def request_id(request: Request) -> str:
    """This request's id (set by the app's outer layer; also the `X-Request-Id` header)."""
    return str(request.scope.get(REQUEST_ID_SCOPE_KEY, "-"))


def internal_error(rid: str) -> dict[str, Any]:
    """The body of a 500: nothing about the failure itself, only where to look in the log."""
    return {
        "error": "internal_error",
        "detail": f"internal error; request id {rid}",
        "request_id": rid,
    }


def sse(event: str | None, data: Any) -> bytes:
    """One server-sent event; `event` None sends a bare `data:` line."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class AnswerLog:
    """One INFO line per answer: outcome, latency and request id; the question itself only
    when asked for, else its length and a short hash (enough to match repeats)."""

    def __init__(self, log_questions: bool) -> None:
        self._log_questions = log_questions

    def __call__(self, question: str, outcome: int | str, started: float, rid: str) -> None:
        shown = (
            repr(question)
            if self._log_questions
            else f"<{len(question)} chars {hashlib.sha256(question.encode()).hexdigest()[:8]}>"
        )
        log.info(
            "answer %s %.0f ms question=%s request_id=%s",
            outcome,
            1000 * (time.perf_counter() - started),
            shown,
            rid,
        )


class StreamFormat(Protocol):
    """How one stream's events are written."""

    def segment(self, event: SegmentEvent) -> bytes:
        """A segment of the leader (index i replaces those ≥ i); b"" sends nothing yet."""
        ...

    def final(self, response: AnswerResponse) -> bytes:
        """The finished answer: the stream's last event."""
        ...

    def error(self, exc: AnswerError, rid: str) -> bytes:
        """A failure after the stream began: the stream's last event."""
        ...

    def end(self) -> bytes:
        """Sent after the last event."""
        ...

    def error_response(self, exc: AnswerError, rid: str) -> Response:
        """A failure before anything was sent: an ordinary error response."""
        ...


class NativeFormat:
    """`/v1/answer/stream`: `segment` events (`SegmentEvent`), then `answer` (the
    `AnswerResponse`) or `error` (`ErrorEvent`)."""

    def __init__(self, error_response: Callable[[AnswerError, str], Response]) -> None:
        self.error_response = error_response

    def segment(self, event: SegmentEvent) -> bytes:
        return sse("segment", event.model_dump(mode="json"))

    def final(self, response: AnswerResponse) -> bytes:
        return sse("answer", response.model_dump(mode="json"))

    def error(self, exc: AnswerError, rid: str) -> bytes:
        if exc.status == 500 and exc.kind == "internal_error":
            event = ErrorEvent(**internal_error(rid), status=500)
        else:
            event = ErrorEvent(error=exc.kind, detail=exc.detail, status=exc.status)
        return sse("error", event.model_dump(mode="json", exclude_none=True))

    def end(self) -> bytes:
        return b""


async def until_disconnect(receive: Receive) -> None:
    """Return once the client has gone (ASGI `http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class AnswerStream:
    """One streamed answer: the decode runs as a task whose steps become segment events, then
    the answer or an error; keep-alives while idle; a disconnect cancels it."""

    def __init__(
        self,
        service: AnswerClient,
        body: AnswerRequest,
        request: Request,
        fmt: StreamFormat,
        *,
        log_answer: AnswerLog,
        metrics: Metrics,
        keepalive_s: float,
        config: DecodingConfig | None = None,
    ) -> None:
        """`config`: the service's `config(body)`, when the caller worked it out already."""
        self._service = service
        self._body = body
        self._config = config
        self._request = request
        self._fmt = fmt
        self._log_answer = log_answer
        self._metrics = metrics
        self._keepalive_s = keepalive_s
        self._rid = request_id(request)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()
        self._leader = LeaderSegments()
        self._idle, self._disconnected = object(), object()

    def _on_step(self, h: Hypothesis) -> None:
        """From the decoder thread: the leader's segments that changed since the last step."""
        for event in self._leader.events(h):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ("segment", event))

    async def _run(self) -> None:
        body, rid = self._body, self._rid
        started = time.perf_counter()
        try:
            result = await self._service.aanswer(body, self._on_step, self._config)
            item: tuple[str, Any] = ("answer", result.response)
            self._log_answer(body.question, "200 stream", started, rid)
        except asyncio.CancelledError:
            self._log_answer(body.question, "cancelled stream", started, rid)
            raise
        except AnswerError as exc:
            item = ("error", exc)
            self._log_answer(body.question, f"{exc.status} stream", started, rid)
        except Exception as exc:
            log.error("internal error; request id %s", rid, exc_info=exc)
            item = ("error", AnswerError("internal error"))
        # Put after any segment events still scheduled by call_soon_threadsafe.
        self._loop.call_soon(self._queue.put_nowait, item)
        self._loop.call_soon(self._queue.put_nowait, None)

    def _encode(self, kind: str, data: Any) -> bytes:
        if kind == "segment":
            return self._fmt.segment(data)
        if kind == "answer":
            return self._fmt.final(data)
        return self._fmt.error(data, self._rid)

    async def respond(self) -> Response:
        task = asyncio.create_task(self._run())
        # Watches the connection for the whole request: before the first event nothing else
        # does, and a decode nobody reads must not hold its in-flight slot.
        gone = asyncio.create_task(until_disconnect(self._request.receive))
        getter: asyncio.Future[tuple[str, Any] | None] = asyncio.ensure_future(self._queue.get())

        def close() -> None:
            if not task.done():
                task.cancel()  # the service cancels the decoder; its slot frees when it ends
                self._metrics.count_stream_abandoned()
            for t in (gone, getter):
                if not t.done():
                    t.cancel()
                elif not t.cancelled():
                    t.exception()  # retrieved: a broken receive just means the client is gone

        async def next_item() -> object:
            """The next queue item; `idle` after keepalive_s without one; `disconnected`."""
            nonlocal getter
            await asyncio.wait(
                {getter, gone}, timeout=self._keepalive_s, return_when=asyncio.FIRST_COMPLETED
            )
            if gone.done():
                return self._disconnected
            if not getter.done():
                return self._idle
            item = getter.result()
            getter = asyncio.ensure_future(self._queue.get())
            return item

        try:
            first = await next_item()
        except BaseException:  # this handler was cancelled (Ray Serve does on a disconnect)
            close()
            raise
        if first is self._disconnected:
            close()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if isinstance(first, tuple) and first[0] == "error":
            # Nothing was sent yet, so the failure can still have its own status code.
            close()
            return self._fmt.error_response(first[1], self._rid)

        return StreamingResponse(
            self._events(first, next_item, close),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(
        self, first: object, next_item: Callable[[], Awaitable[object]], close: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        """The stream's bytes from `first` on: each event encoded, a keep-alive when idle, the
        format's end after the last; `close` once it ends, however it ends."""
        item = first
        try:
            while item is not None and item is not self._disconnected:
                if item is self._idle:
                    yield KEEPALIVE
                else:
                    chunk = self._encode(*item)  # type: ignore[misc]
                    if chunk:
                        yield chunk
                item = await next_item()
            if item is None:
                if end := self._fmt.end():
                    yield end
        finally:
            close()
