"""The HTTP API as a FastAPI app around an answer service; no Ray here, so it tests quickly.

Routes: `POST /v1/answer`, `POST /v1/answer/stream` (server-sent events), `GET /healthz`,
`GET /readyz`, `GET /metrics`, and FastAPI's `/openapi.json` and `/docs`.
Every error body is `{"error": <slug>, "detail": <text or list>}`; an internal error says only
`internal error; request id <id>` (and `request_id`), its detail goes to the log under that id.
Every response carries `X-Request-Id`: the client's own when it is a sane token, else a new one.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from selfrag.actors.metrics import Metrics
from selfrag.pipeline.decoder import StepListener
from selfrag.pipeline.ranking import Hypothesis
from selfrag.runtime.answering import Answer
from selfrag.schemas.answer import AnswerRequest, AnswerResponse, SegmentOut
from selfrag.schemas.errors import AnswerError, ErrorBody
from selfrag.schemas.events import ErrorEvent, SegmentEvent

log = logging.getLogger("selfrag.http")

MAX_BODY_BYTES = 64 * 1024
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
KEEPALIVE_S = 10.0
"""A stream with no event for this long sends an SSE comment, so proxies keep it open."""
KEEPALIVE = b": keep-alive\n\n"
REQUEST_ID_HEADER = "X-Request-Id"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; only metrics see it

# A client's request id is echoed (and logged) only if it is a short plain token.
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_REQUEST_ID_KEY = "selfrag.request_id"  # in the ASGI scope


class PayloadTooLarge(StarletteHTTPException):
    """The request body passed `MAX_BODY_BYTES` (raised while it is read)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over {limit} bytes")


class AnswerService(Protocol):
    """What the HTTP layer needs from the system behind it."""

    async def answer(self, request: AnswerRequest, on_step: StepListener | None = None) -> Answer:
        """Answer one request; `on_step` may be called from any thread."""
        ...

    async def readiness(self) -> dict[str, bool]:
        """Each dependency (model, store, cache) and whether it answers now."""
        ...

    async def metrics_text(self) -> list[str]:
        """Prometheus lines the service adds to `/metrics` (e.g. batch sizes)."""
        ...


def parse_api_keys(raw: str | None) -> list[SecretStr]:
    """`SELFRAG_API_KEYS`: comma-separated; blanks ignored; empty means auth is off."""
    return [SecretStr(k.strip()) for k in (raw or "").split(",") if k.strip()]


def _error(
    status: int, error: str, detail: Any, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


def request_id(request: Request) -> str:
    """This request's id (set by the app's outer layer; also the `X-Request-Id` header)."""
    return str(request.scope.get(_REQUEST_ID_KEY, "-"))


def internal_error(rid: str) -> dict[str, Any]:
    """The body of a 500: nothing about the failure itself, only where to look in the log."""
    return {
        "error": "internal_error",
        "detail": f"internal error; request id {rid}",
        "request_id": rid,
    }


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _REQUEST_ID.fullmatch(text) else None
    return None


class _Edge:
    """The outermost layer of the app (pure ASGI, so streams pass through untouched): the
    request id, the body limit enforced while the body is read (a chunked body has no
    Content-Length to check), request metrics, and a generic 500 for anything unhandled."""

    def __init__(self, app: ASGIApp, metrics: Metrics, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _incoming_request_id(scope) or uuid.uuid4().hex
        scope[_REQUEST_ID_KEY] = rid
        start = time.perf_counter()
        started = False
        received = 0
        limit = self.max_body_bytes

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(limit)
            return message

        async def tagged_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
                route = scope.get("route")
                self.metrics.observe_request(
                    scope["method"],
                    getattr(route, "path", None) or "other",
                    int(message["status"]),
                    time.perf_counter() - start,
                )
            await send(message)

        length = dict(scope.get("headers", ())).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            # Refused before reading a byte of it.
            exc = PayloadTooLarge(limit)
            await _error(413, "payload_too_large", exc.detail)(scope, receive, tagged_send)
            return
        try:
            await self.app(scope, limited_receive, tagged_send)
        except Exception as exc:
            if isinstance(exc, PayloadTooLarge) and not started:
                # The body was read outside a route's error handling.
                await _error(413, "payload_too_large", exc.detail)(scope, receive, tagged_send)
                return
            log.error("internal error; request id %s", rid, exc_info=exc)
            if started:  # too late for a status: the server ends the connection
                raise
            await JSONResponse(internal_error(rid), status_code=500)(scope, receive, tagged_send)


async def _until_disconnect(receive: Receive) -> None:
    """Return once the client has gone (ASGI `http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _field(loc: Sequence[int | str]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or "body"


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


# Every error has the same body (`ErrorBody`); OpenAPI documents it per status.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in (
        (401, "missing or invalid API key"),
        (413, "request body too large"),
        (422, "invalid request, or one this server cannot answer as configured"),
        (500, "internal error or misconfigured deployment"),
        (503, "overloaded or a dependency is down; retry after Retry-After seconds"),
        (504, "no answer within timeout_s"),
    )
}


class _Failures:
    """How an `AnswerError` becomes a response: its status and kind, `Retry-After` on a 503, and
    nothing about an internal failure but the request id."""

    def __init__(self, retry_after_s: int) -> None:
        self.retry_after = {"Retry-After": str(retry_after_s)}

    def response(self, exc: AnswerError, rid: str) -> JSONResponse:
        headers = self.retry_after if exc.status == 503 else None
        if exc.status == 500 and exc.kind == "internal_error":
            return JSONResponse(internal_error(rid), status_code=500, headers=headers)
        return _error(exc.status, exc.kind, exc.detail, headers)

    def install(self, app: FastAPI) -> None:
        """The handlers that give every error the same body: {error, detail}."""

        @app.exception_handler(RequestValidationError)
        async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
            detail = [
                {
                    "field": _field(e.get("loc", ())),
                    "message": e.get("msg", ""),
                    "type": e.get("type"),
                }
                for e in exc.errors()
            ]
            return _error(422, "invalid_request", detail)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
            slug = {
                401: "unauthorized",
                404: "not_found",
                405: "method_not_allowed",
                413: "payload_too_large",
            }.get(exc.status_code, "http_error")
            return _error(exc.status_code, slug, exc.detail, dict(exc.headers or {}))

        @app.exception_handler(AnswerError)
        async def answer_error(request: Request, exc: AnswerError) -> JSONResponse:
            return self.response(exc, request_id(request))


def api_key_check(api_keys: Sequence[SecretStr]) -> Callable[[Request], None]:
    """A FastAPI dependency: with keys, a request needs one of them as `Authorization: Bearer
    <key>` or `X-API-Key: <key>` (401 otherwise); without keys it lets everything through."""
    keys = [k.get_secret_value().encode() for k in api_keys]

    def require_key(request: Request) -> None:
        if not keys:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        given = given or request.headers.get("x-api-key", "")
        # Compare against every key so timing does not reveal which one nearly matched.
        ok = False
        for key in keys:
            ok |= hmac.compare_digest(given.encode(), key)
        if not ok:
            raise StarletteHTTPException(
                401, "missing or invalid API key", headers={"WWW-Authenticate": "Bearer"}
            )

    return require_key


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


class _AnswerStream:
    """One `/v1/answer/stream` request: the decode runs as a task whose steps become `segment`
    events, then `answer` or `error`; keep-alives while idle; a disconnect cancels it."""

    def __init__(
        self,
        service: AnswerService,
        body: AnswerRequest,
        request: Request,
        *,
        failures: _Failures,
        log_answer: AnswerLog,
        metrics: Metrics,
        keepalive_s: float,
    ) -> None:
        self._service = service
        self._body = body
        self._request = request
        self._failures = failures
        self._log_answer = log_answer
        self._metrics = metrics
        self._keepalive_s = keepalive_s
        self._rid = request_id(request)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()
        self._sent: list[SegmentOut] = []
        self._idle, self._disconnected = object(), object()

    def _on_step(self, h: Hypothesis) -> None:
        """From the decoder thread: the leader's segments that changed since the last step."""
        segments = list(h.segments)
        start = 0
        while start < min(len(self._sent), len(segments)) and self._sent[start] == segments[start]:
            start += 1
        for i in range(start, len(segments)):
            event = SegmentEvent(index=i, segment=segments[i], hypothesis_score=h.score)
            self._loop.call_soon_threadsafe(
                self._queue.put_nowait, ("segment", event.model_dump(mode="json"))
            )
        self._sent[:] = segments

    async def _run(self) -> None:
        body, rid = self._body, self._rid
        started = time.perf_counter()
        try:
            result = await self._service.answer(body, self._on_step)
            item: tuple[str, Any] = ("answer", result.response.model_dump(mode="json"))
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

    async def respond(self) -> Response:
        task = asyncio.create_task(self._run())
        # Watches the connection for the whole request: before the first event nothing else
        # does, and a decode nobody reads must not hold its in-flight slot.
        gone = asyncio.create_task(_until_disconnect(self._request.receive))
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
            return self._failures.response(first[1], self._rid)

        async def events() -> AsyncIterator[bytes]:
            item = first
            try:
                while item is not None and item is not self._disconnected:
                    if item is self._idle:
                        yield KEEPALIVE
                    else:
                        kind, data = item  # type: ignore[misc]
                        if kind == "error":
                            data = _error_event(data, self._rid)
                        yield _sse(kind, data)
                    item = await next_item()
            finally:
                close()

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


def build_http_app(
    service: AnswerService,
    metrics: Metrics,
    *,
    api_keys: Sequence[SecretStr] = (),
    title: str = "selfrag",
    retry_after_s: int = 2,
    log_questions: bool = False,
    keepalive_s: float = KEEPALIVE_S,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app. With `api_keys`, `/v1/*` and `/metrics` need one of them as
    `Authorization: Bearer <key>` or `X-API-Key: <key>`; probes and docs stay open.
    Every 503 carries `Retry-After: retry_after_s`. Each answer is logged at INFO with its
    status, latency and request id; the question text only with `log_questions`. A stream
    sends `: keep-alive` every `keepalive_s` without an event; a body over `max_body_bytes`
    is refused (413) as soon as that many bytes have arrived."""
    failures = _Failures(retry_after_s)
    log_answer = AnswerLog(log_questions)
    app = FastAPI(
        title=title,
        summary="Self-RAG answers with per-segment citations and critique scores.",
        version="1",
    )
    # Cross-cutting: request id, body limit, metrics, errors.
    app.add_middleware(_Edge, metrics=metrics, max_body_bytes=max_body_bytes)
    failures.install(app)
    authed = [Depends(api_key_check(api_keys))]

    @app.post(
        "/v1/answer", response_model=AnswerResponse, dependencies=authed, responses=ERROR_RESPONSES
    )
    async def answer(body: AnswerRequest, request: Request, response: Response) -> AnswerResponse:
        """Answer a question; `config` overrides any decoding dial for this request.
        503 (overloaded, dependency down; with `Retry-After`), 504 past `timeout_s`."""
        started = time.perf_counter()
        rid = request_id(request)
        try:
            result = await service.answer(body)
        except AnswerError as exc:
            log_answer(body.question, exc.status, started, rid)
            raise
        log_answer(body.question, 200, started, rid)
        response.headers["X-Cache"] = result.cache
        return result.response

    @app.post(
        "/v1/answer/stream",
        dependencies=authed,
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}, **ERROR_RESPONSES},
    )
    async def answer_stream(body: AnswerRequest, request: Request) -> Response:
        """Server-sent events: `segment` after each decoding step (`index` i replaces any
        segment with index ≥ i sent before, since the beam's leader can change), then
        `answer` with the full response, or `error`; `: keep-alive` comments while no event
        is ready. A failure before anything was sent has its own status code, as on
        `/v1/answer`. A client that disconnects cancels its decode."""
        stream = _AnswerStream(
            service,
            body,
            request,
            failures=failures,
            log_answer=log_answer,
            metrics=metrics,
            keepalive_s=keepalive_s,
        )
        return await stream.respond()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: 200 only when the model, the store and the cache all answer."""
        try:
            checks = await service.readiness()
        except Exception as exc:
            rid = request_id(request)
            log.warning("readiness check failed; request id %s", rid, exc_info=exc)
            return _error(
                503, "not_ready", f"readiness check failed; request id {rid}", failures.retry_after
            )
        ready = all(checks.values())
        return JSONResponse(
            {"ready": ready, "checks": checks},
            status_code=200 if ready else 503,
            headers=None if ready else failures.retry_after,
        )

    @app.get("/metrics", dependencies=authed, response_class=PlainTextResponse)
    async def prometheus() -> Response:
        """Prometheus text exposition."""
        try:
            extra = await service.metrics_text()
        except Exception as exc:
            log.warning("service metrics unavailable: %s", exc)
            extra = []
        return Response(metrics.render(extra), media_type=PROMETHEUS_CONTENT_TYPE)

    return app


def _error_event(exc: AnswerError, rid: str) -> dict[str, Any]:
    """The data of a stream's `error` event."""
    if exc.status == 500 and exc.kind == "internal_error":
        event = ErrorEvent(**internal_error(rid), status=500)
    else:
        event = ErrorEvent(error=exc.kind, detail=exc.detail, status=exc.status)
    return event.model_dump(mode="json", exclude_none=True)
