"""The HTTP API as a FastAPI app around an answer service; no Ray here, so it tests quickly.

Routes: `POST /v1/answer`, `POST /v1/answer/stream` (server-sent events), `GET /healthz`,
`GET /readyz`, `GET /metrics`, and FastAPI's `/openapi.json` and `/docs`.
Every error body is `{"error": <slug>, "detail": <text or list>}`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.metrics import Metrics
from pipeline.ranking import Hypothesis
from schemas.answer import AnswerRequest, AnswerResponse, SegmentOut

log = logging.getLogger("selfrag.http")

MAX_BODY_BYTES = 64 * 1024
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

StepListener = Callable[[Hypothesis], None]
CacheStatus = Literal["hit", "miss", "off", "error"]


class ServiceError(Exception):
    """A failure with an HTTP status; `detail` is safe to show to the client."""

    status = 500
    error = "internal_error"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Overloaded(ServiceError):
    status = 503
    error = "overloaded"


class DependencyDown(ServiceError):
    status = 503
    error = "dependency_unavailable"


class DeadlineExceeded(ServiceError):
    status = 504
    error = "deadline_exceeded"


class Misconfigured(ServiceError):
    """A permanent fault of the deployment (e.g. the index does not match the embedder):
    retrying cannot help, so no `Retry-After`; an operator must fix it."""

    status = 500
    error = "misconfigured"


class Unprocessable(ServiceError):
    """The request is well-formed but cannot be answered as configured (e.g. `native`
    critique on a model without reflection tokens)."""

    status = 422
    error = "unprocessable"


@dataclass(frozen=True)
class Answer:
    response: AnswerResponse
    cache: CacheStatus


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


def _field(loc: Sequence[int | str]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or "body"


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def build_http_app(
    service: AnswerService,
    metrics: Metrics,
    *,
    api_keys: Sequence[SecretStr] = (),
    title: str = "selfrag",
    retry_after_s: int = 2,
    log_questions: bool = False,
) -> FastAPI:
    """The FastAPI app. With `api_keys`, `/v1/*` and `/metrics` need one of them as
    `Authorization: Bearer <key>` or `X-API-Key: <key>`; probes and docs stay open.
    Every 503 carries `Retry-After: retry_after_s`. Each answer is logged at INFO with its
    status and latency; the question text only with `log_questions`."""
    keys = [k.get_secret_value().encode() for k in api_keys]
    retry_after = {"Retry-After": str(retry_after_s)}

    def service_failure(exc: ServiceError) -> JSONResponse:
        return _error(exc.status, exc.error, exc.detail, retry_after if exc.status == 503 else None)

    def log_answer(question: str, outcome: int | str, started: float) -> None:
        # User text stays out of logs unless asked for: a length and a short hash still let
        # an operator match repeated questions.
        shown = (
            repr(question)
            if log_questions
            else f"<{len(question)} chars {hashlib.sha256(question.encode()).hexdigest()[:8]}>"
        )
        log.info(
            "answer %s %.0f ms question=%s", outcome, 1000 * (time.perf_counter() - started), shown
        )

    app = FastAPI(
        title=title,
        summary="Self-RAG answers with per-segment citations and critique scores.",
        version="1",
    )

    # --- cross-cutting: body limit, metrics, errors ----------------------------------------------

    @app.middleware("http")
    async def count_requests(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        start = time.perf_counter()
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            response: Response = _error(
                413, "payload_too_large", f"request body over {MAX_BODY_BYTES} bytes"
            )
        else:
            response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", None) or "other"
        metrics.observe_request(
            request.method, path, response.status_code, time.perf_counter() - start
        )
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [
            {"field": _field(e.get("loc", ())), "message": e.get("msg", ""), "type": e.get("type")}
            for e in exc.errors()
        ]
        return _error(422, "invalid_request", detail)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        slug = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "http_error"
        )
        return _error(exc.status_code, slug, exc.detail, dict(exc.headers or {}))

    @app.exception_handler(ServiceError)
    async def service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return service_failure(exc)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}")

    # --- auth ----------------------------------------------------------------------------------

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

    authed = [Depends(require_key)]

    # --- routes ----------------------------------------------------------------------------------

    @app.post("/v1/answer", response_model=AnswerResponse, dependencies=authed)
    async def answer(body: AnswerRequest, response: Response) -> AnswerResponse:
        """Answer a question; `config` overrides any decoding dial for this request.
        503 (overloaded, dependency down; with `Retry-After`), 504 past `timeout_s`."""
        started = time.perf_counter()
        try:
            result = await service.answer(body)
        except ServiceError as exc:
            log_answer(body.question, exc.status, started)
            raise
        log_answer(body.question, 200, started)
        response.headers["X-Cache"] = result.cache
        return result.response

    @app.post(
        "/v1/answer/stream",
        dependencies=authed,
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def answer_stream(body: AnswerRequest) -> Response:
        """Server-sent events: `segment` after each decoding step (`index` i replaces any
        segment with index ≥ i sent before, since the beam's leader can change), then
        `answer` with the full response, or `error`."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()
        sent: list[SegmentOut] = []

        def on_step(h: Hypothesis) -> None:
            segments = list(h.segments)
            start = 0
            while start < min(len(sent), len(segments)) and sent[start] == segments[start]:
                start += 1
            for i in range(start, len(segments)):
                event = {
                    "index": i,
                    "segment": segments[i].model_dump(mode="json"),
                    "hypothesis_score": h.score,
                }
                loop.call_soon_threadsafe(queue.put_nowait, ("segment", event))
            sent[:] = segments

        async def run() -> None:
            started = time.perf_counter()
            try:
                result = await service.answer(body, on_step)
                item: tuple[str, Any] = ("answer", result.response.model_dump(mode="json"))
                log_answer(body.question, "200 stream", started)
            except ServiceError as exc:
                item = ("error", exc)
                log_answer(body.question, f"{exc.status} stream", started)
            except Exception as exc:
                log.exception("stream failed")
                item = ("error", ServiceError(f"{type(exc).__name__}: {exc}"))
            # Put after any segment events still scheduled by call_soon_threadsafe.
            loop.call_soon(queue.put_nowait, item)
            loop.call_soon(queue.put_nowait, None)

        task = asyncio.create_task(run())
        first = await queue.get()
        if first is not None and first[0] == "error":
            # Nothing was streamed yet, so the failure can still have its own status code.
            task.cancel()
            exc = first[1]
            return service_failure(exc)

        async def events() -> AsyncIterator[bytes]:
            item = first
            try:
                while item is not None:
                    kind, data = item
                    if kind == "error":
                        data = {"error": data.error, "detail": data.detail, "status": data.status}
                    yield _sse(kind, data)
                    item = await queue.get()
            finally:
                if not task.done():
                    task.cancel()

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Readiness: 200 only when the model, the store and the cache all answer."""
        try:
            checks = await service.readiness()
        except Exception as exc:
            log.warning("readiness check failed: %s", exc)
            return _error(503, "not_ready", f"{type(exc).__name__}: {exc}")
        ready = all(checks.values())
        return JSONResponse(
            {"ready": ready, "checks": checks},
            status_code=200 if ready else 503,
            headers=None if ready else retry_after,
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
