"""The HTTP API as a FastAPI app around an answer client (`runtime.answer_client.AnswerClient`:
in this process, or through Ray Serve's deployments); no Ray here, so it tests quickly.

Routes: `POST /v1/answer`, `POST /v1/answer/stream` (server-sent events), `GET /healthz` (and
`GET /health`, the name vLLM uses),
`GET /readyz`, `GET /metrics`, the playground page at `GET /` (actors/http/playground.py), the
OpenAI-compatible `/v1/models`, `/v1/chat/completions` and `/v1/completions`
(actors/http/openai_routes.py), and the OpenAPI document at `/openapi.json` (no `/docs`: FastAPI's
Swagger UI loads its scripts from a CDN, which would run on the playground's origin).
Every POST needs `Content-Type: application/json` (415), and a server bound to loopback
answers only requests that name it in `Host` (421; actors/http/guards.py).
Every error body is `{"error": <slug>, "detail": <text or list>}` (OpenAI's envelope on the
OpenAI routes); an internal error says only
`internal error; request id <id>` (and `request_id`), its detail goes to the log under that id.
Every response carries `X-Request-Id`: the client's own when it is a sane token, else a new one.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from selfrag.actors.http.documents_routes import DocumentService, add_document_routes
from selfrag.actors.http.guards import HostCheck, SharedReadiness, require_json
from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.openai_format import OpenAIError
from selfrag.actors.http.openai_routes import add_openai_routes, is_openai_path
from selfrag.actors.http.playground import add_playground
from selfrag.actors.http.streaming import (
    KEEPALIVE_S,
    REQUEST_ID_SCOPE_KEY,
    AnswerLog,
    AnswerStream,
    NativeFormat,
    internal_error,
    request_id,
)
from selfrag.runtime.answer_client import AnswerClient
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.errors import AnswerError, ErrorBody

log = logging.getLogger("selfrag.http")

MAX_BODY_BYTES = 64 * 1024
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# A client's request id is echoed (and logged) only if it is a short plain token.
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


class PayloadTooLarge(StarletteHTTPException):
    """The request body passed `MAX_BODY_BYTES` (raised while it is read)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over {limit} bytes")


def parse_api_keys(raw: str | None) -> list[SecretStr]:
    """`SELFRAG_API_KEYS`: comma-separated; blanks ignored; empty means auth is off."""
    return [SecretStr(k.strip()) for k in (raw or "").split(",") if k.strip()]


def _error(
    status: int,
    error: str,
    detail: Any,
    headers: dict[str, str] | None = None,
    *,
    path: str = "",
) -> JSONResponse:
    """The error body of `path`: `{error, detail}`, or OpenAI's envelope on its routes."""
    if is_openai_path(path):
        return OpenAIError(status, str(detail), code=error, headers=headers).response()
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _REQUEST_ID.fullmatch(text) else None
    return None


class _Edge:
    """The outermost layer of the app (pure ASGI, so streams pass through untouched): the
    request id, the Host check of a loopback server, the body limit enforced while the body
    is read (a chunked body has no Content-Length to check), request metrics (labelled by
    route, `unmatched` when none), `X-Content-Type-Options: nosniff`, and a generic 500 for
    anything unhandled."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics,
        max_body_bytes: int,
        host_check: HostCheck | None = None,
        request_id_header: bool = True,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.host_check = host_check
        self.request_id_header = request_id_header

    def _refusal_before_reading(self, scope: Scope) -> JSONResponse | None:
        """The 421 of a Host this server does not answer to, or the 413 of a declared body
        over the limit (refused before reading a byte of it); None for a request to serve."""
        headers = dict(scope.get("headers", ()))
        refused = self.host_check.refusal(headers.get(b"host")) if self.host_check else None
        if refused is not None:
            return _error(421, "misdirected_request", refused, path=scope["path"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            exc = PayloadTooLarge(self.max_body_bytes)
            return _error(413, "payload_too_large", exc.detail, path=scope["path"])
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _incoming_request_id(scope) or uuid.uuid4().hex
        scope[REQUEST_ID_SCOPE_KEY] = rid
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
                headers = [*message.get("headers", ()), (b"x-content-type-options", b"nosniff")]
                if self.request_id_header:
                    headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
                route = scope.get("route")
                self.metrics.observe_request(
                    scope["method"],
                    getattr(route, "path", None) or "unmatched",
                    int(message["status"]),
                    time.perf_counter() - start,
                )
            await send(message)

        refusal = self._refusal_before_reading(scope)
        if refusal is not None:
            await refusal(scope, receive, tagged_send)
            return
        try:
            await self.app(scope, limited_receive, tagged_send)
        except Exception as exc:
            if isinstance(exc, PayloadTooLarge) and not started:
                # The body was read outside a route's error handling.
                error = _error(413, "payload_too_large", exc.detail, path=scope["path"])
                await error(scope, receive, tagged_send)
                return
            log.error("internal error; request id %s", rid, exc_info=exc)
            if started:  # too late for a status: the server ends the connection
                raise
            body = internal_error(rid)
            error = (
                _error(500, "internal_error", body["detail"], path=scope["path"])
                if is_openai_path(scope["path"])
                else JSONResponse(body, status_code=500)
            )
            await error(scope, receive, tagged_send)


def _field(loc: Sequence[int | str]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or "body"


# Every error has the same body (`ErrorBody`); OpenAPI documents it per status.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in (
        (401, "missing or invalid API key"),
        (413, "request body too large"),
        (415, "the body is not declared application/json"),
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
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            slug = {
                400: "bad_request",
                401: "unauthorized",
                404: "not_found",
                405: "method_not_allowed",
                413: "payload_too_large",
                415: "unsupported_media_type",
            }.get(exc.status_code, "http_error")
            headers = dict(exc.headers or {})
            return _error(exc.status_code, slug, exc.detail, headers, path=request.url.path)

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


def _app_with_edge(
    title: str,
    metrics: Metrics,
    failures: _Failures,
    max_body_bytes: int,
    host_check: HostCheck,
    request_id_header: bool,
) -> FastAPI:
    """An app without routes yet, behind the cross-cutting edge (request id, Host check, body
    limit, metrics, a 500 for anything unhandled), with `failures`' error handlers."""
    app = FastAPI(
        title=title,
        summary="Self-RAG answers with per-segment citations and critique scores.",
        version="1",
        # The OpenAPI document only: FastAPI's /docs and /redoc pages load scripts from a CDN.
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(
        _Edge,
        metrics=metrics,
        max_body_bytes=max_body_bytes,
        host_check=host_check,
        request_id_header=request_id_header,
    )
    failures.install(app)
    return app


def build_http_app(
    service: AnswerClient,
    metrics: Metrics,
    *,
    api_keys: Sequence[SecretStr] = (),
    title: str = "selfrag",
    retry_after_s: int = 2,
    log_questions: bool = False,
    keepalive_s: float = KEEPALIVE_S,
    max_body_bytes: int = MAX_BODY_BYTES,
    model_name: str = "selfrag",
    bind_host: str | None = None,
    allowed_hosts: Sequence[str] = (),
    readiness_ttl_s: float = 1.0,
    request_id_header: bool = True,
    documents: DocumentService | None = None,
) -> FastAPI:
    """The FastAPI app. With `api_keys`, `/v1/*` and `/metrics` need one of them as
    `Authorization: Bearer <key>` or `X-API-Key: <key>`; probes, the OpenAPI document and
    the playground page stay open. Every POST needs `Content-Type: application/json` (415).
    When `bind_host` (the address the server listens on) is loopback, a request whose
    `Host` names neither loopback, `bind_host` nor one of `allowed_hosts` gets 421.
    `/readyz` reuses one check's result for `readiness_ttl_s` seconds.
    Every 503 carries `Retry-After: retry_after_s`. Each answer is logged at INFO with its
    status, latency and request id; the question text only with `log_questions`. A stream
    sends `: keep-alive` every `keepalive_s` without an event; a body over `max_body_bytes`
    is refused (413) as soon as that many bytes have arrived. The OpenAI-compatible routes
    (actors/http/openai_routes.py) serve `model_name`. Without `request_id_header` the app leaves
    the `X-Request-Id` response header to the proxy in front of it (Ray Serve's echoes the id it
    put on the request, which is the id this app uses), so a response carries it once."""
    failures = _Failures(retry_after_s)
    log_answer = AnswerLog(log_questions)
    host_check = HostCheck.for_bind(bind_host, allowed_hosts)
    app = _app_with_edge(title, metrics, failures, max_body_bytes, host_check, request_id_header)
    authed = [Depends(api_key_check(api_keys))]
    posted = [*authed, Depends(require_json)]
    readiness = SharedReadiness(service.readiness, readiness_ttl_s)

    _add_answer_routes(app, service, metrics, failures, log_answer, posted, keepalive_s)
    _add_probe_routes(app, service, metrics, failures, readiness, authed)
    add_openai_routes(
        app,
        service,
        metrics,
        model_name=model_name,
        authed=authed,
        posted=posted,
        log_answer=log_answer,
        keepalive_s=keepalive_s,
        retry_after_s=retry_after_s,
    )
    if documents is not None:
        add_document_routes(app, documents, authed, keys_set=bool(api_keys))
    add_playground(app)
    return app


def _add_answer_routes(
    app: FastAPI,
    service: AnswerClient,
    metrics: Metrics,
    failures: _Failures,
    log_answer: AnswerLog,
    posted: list[Any],
    keepalive_s: float,
) -> None:
    """`POST /v1/answer` and `POST /v1/answer/stream`."""

    @app.post(
        "/v1/answer", response_model=AnswerResponse, dependencies=posted, responses=ERROR_RESPONSES
    )
    async def answer(body: AnswerRequest, request: Request, response: Response) -> AnswerResponse:
        """Answer a question; `config` overrides any decoding dial for this request.
        503 (overloaded, dependency down; with `Retry-After`), 504 past `timeout_s`."""
        started = time.perf_counter()
        rid = request_id(request)
        try:
            result = await service.run(body)
        except AnswerError as exc:
            log_answer(body.question, exc.status, started, rid)
            raise
        log_answer(body.question, 200, started, rid)
        response.headers["X-Cache"] = result.cache
        return result.response

    @app.post(
        "/v1/answer/stream",
        dependencies=posted,
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}, **ERROR_RESPONSES},
    )
    async def answer_stream(body: AnswerRequest, request: Request) -> Response:
        """Server-sent events: `segment` after each decoding step (`index` i replaces any
        segment with index ≥ i sent before, since the beam's leader can change), then
        `answer` with the full response, or `error`; `: keep-alive` comments while no event
        is ready. A failure before anything was sent has its own status code, as on
        `/v1/answer`. A client that disconnects cancels its decode."""
        stream = AnswerStream(
            service,
            body,
            request,
            NativeFormat(failures.response),
            log_answer=log_answer,
            metrics=metrics,
            keepalive_s=keepalive_s,
        )
        return await stream.respond()


def _add_probe_routes(
    app: FastAPI,
    service: AnswerClient,
    metrics: Metrics,
    failures: _Failures,
    readiness: SharedReadiness,
    authed: list[Any],
) -> None:
    """`/healthz`, `/readyz` and `/metrics`."""

    @app.get("/healthz")
    @app.get("/health")
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: 200 only when the model, the store and the cache all answer. One check
        answers every call within a second (concurrent calls share it)."""
        try:
            checks = await readiness()
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
        """Prometheus text exposition of this process: its request, answer and cache series,
        and its process metrics. Every replica's series, the engine replicas' batch sizes
        among them, are in Ray's metrics export."""
        try:
            await service.collect_metrics()
        except Exception as exc:
            log.warning("service metrics unavailable: %s", exc)
        return Response(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)
