"""The HTTP API as a FastAPI app around an answer client (`runtime.answer_client.AnswerClient`:
in this process, or through Ray Serve's deployments); no Ray here, so it tests quickly.

Routes: `POST /v1/answer`, `POST /v1/answer/stream` (server-sent events), `POST /v1/config` (a
request's settled config), `POST /v1/retrieve` (passages ranked by s_rel, no drafting),
`GET /healthz` (and `GET /health`, the name vLLM uses), `GET /readyz` (readiness, and the home
and collection served), `GET /metrics`, the playground page at `GET /`
(actors/http/playground.py), the OpenAI-compatible `/v1/models`, `/v1/chat/completions` and
`/v1/completions` (actors/http/openai_routes.py), and the OpenAPI document at `/openapi.json`
(no `/docs`: FastAPI's Swagger UI loads its scripts from a CDN, which would run on the
playground's origin).
Every POST needs `Content-Type: application/json` (415), a server bound to loopback
answers only requests that name it in `Host` (421), and a request naming a home or collection
(`X-Selfrag-Home`, `X-Selfrag-Collection`) that this server does not serve is refused (409;
actors/http/guards.py).
Every error body is `{"error": <slug>, "detail": <text or list>}` (OpenAI's envelope on the
OpenAI routes); an internal error says only
`internal error; request id <id>` (and `request_id`), its detail goes to the log under that id.
Every response carries `X-Request-Id`: the client's own when it is a sane token, else a new one.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from selfrag.actors.http.documents_routes import DocumentService, add_document_routes
from selfrag.actors.http.guards import HostCheck, SharedReadiness, require_json, served_check
from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.openai_routes import add_openai_routes
from selfrag.actors.http.playground import add_playground
from selfrag.actors.http.request_edge import RequestEdge, error_response
from selfrag.actors.http.streaming import (
    KEEPALIVE_S,
    AnswerLog,
    AnswerStream,
    NativeFormat,
    internal_error,
    request_id,
)
from selfrag.runtime.answer_client import AnswerClient, LocalAnswerClient
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import AnswerError, ErrorBody
from selfrag.schemas.health import Health
from selfrag.schemas.retrieval import RetrieveRequest, RetrieveResponse

log = logging.getLogger("selfrag.http")

MAX_BODY_BYTES = 64 * 1024
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def parse_api_keys(raw: str | None) -> list[SecretStr]:
    """`SELFRAG_API_KEYS`: comma-separated; blanks ignored; empty means auth is off."""
    return [SecretStr(k.strip()) for k in (raw or "").split(",") if k.strip()]


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
        (409, "the request names a home or collection this server does not serve"),
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
        return error_response(exc.status, exc.kind, exc.detail, headers)

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
            return error_response(422, "invalid_request", detail)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            slug = {
                400: "bad_request",
                401: "unauthorized",
                404: "not_found",
                405: "method_not_allowed",
                409: "wrong_home",
                413: "payload_too_large",
                415: "unsupported_media_type",
            }.get(exc.status_code, "http_error")
            headers = dict(exc.headers or {})
            return error_response(exc.status_code, slug, exc.detail, headers, path=request.url.path)

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
        RequestEdge,
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
    the playground page stay open. Every POST needs `Content-Type: application/json` (415);
    a request naming another home or collection than `service` serves is refused (409).
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
    readiness = SharedReadiness(service.health, readiness_ttl_s)
    authed = [Depends(api_key_check(api_keys)), Depends(served_check(readiness))]
    posted = [*authed, Depends(require_json)]

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


def build_local_http_app(client: LocalAnswerClient, **options: Any) -> FastAPI:
    """The HTTP app in this process, without Ray Serve: `client` (e.g. `SelfRAG.client`)
    reporting to the app's own `Metrics`, so `/metrics` counts its answers, cache lookups,
    deadlines and answers in flight as the Serve ingress does. `options`: `build_http_app`'s."""
    metrics = Metrics()
    return build_http_app(client.reporting(metrics), metrics, **options)


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
            result = await service.aanswer(body)
        except AnswerError as exc:
            log_answer(body.question, exc.status, started, rid)
            raise
        log_answer(body.question, 200, started, rid)
        response.headers["X-Cache"] = result.cache
        return result.response

    @app.post(
        "/v1/config", response_model=DecodingConfig, dependencies=posted, responses=ERROR_RESPONSES
    )
    async def config(body: AnswerRequest) -> DecodingConfig:
        """The config this request would be answered with: its dials over the server's
        defaults, the critique source resolved and every filter filled (with the support
        threshold calibrated for the model, critique source and collection). Nothing is
        answered."""
        return await service.aconfig(body)

    @app.post(
        "/v1/retrieve",
        response_model=RetrieveResponse,
        dependencies=posted,
        responses=ERROR_RESPONSES,
    )
    async def retrieve(body: RetrieveRequest) -> RetrieveResponse:
        """The store's `top_k` passages for the query, most relevant first by the critique's
        relevance read (s_rel), or in the store's order (`order: retriever`); no answer is
        drafted."""
        return RetrieveResponse(passages=await service.aretrieve(body))

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

    @app.get("/readyz", response_model=Health, responses={503: {"model": Health}})
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: 200 only when the model, the store and the cache all answer; with the
        home (its id) and collection served. One check answers every call within a second
        (concurrent calls share it)."""
        try:
            health = await readiness()
        except Exception as exc:
            rid = request_id(request)
            log.warning("readiness check failed; request id %s", rid, exc_info=exc)
            return error_response(
                503, "not_ready", f"readiness check failed; request id {rid}", failures.retry_after
            )
        return JSONResponse(
            health.model_dump(mode="json"),
            status_code=200 if health.ready else 503,
            headers=None if health.ready else failures.retry_after,
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
