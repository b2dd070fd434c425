"""The outermost layer of the HTTP app (`RequestEdge`, pure ASGI) and the error body every
refusal shares (`error_response`)."""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from selfrag.actors.http.guards import HostCheck
from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.openai_format import OpenAIError
from selfrag.actors.http.openai_routes import is_openai_path
from selfrag.actors.http.streaming import REQUEST_ID_SCOPE_KEY, internal_error

log = logging.getLogger("selfrag.http")

# A client's request id is echoed (and logged) only if it is a short plain token.
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


class PayloadTooLarge(StarletteHTTPException):
    """The request body passed the app's body limit (raised while it is read)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over {limit} bytes")


def error_response(
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


class RequestEdge:
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
            return error_response(421, "misdirected_request", refused, path=scope["path"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            exc = PayloadTooLarge(self.max_body_bytes)
            return error_response(413, "payload_too_large", exc.detail, path=scope["path"])
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
                error = error_response(413, "payload_too_large", exc.detail, path=scope["path"])
                await error(scope, receive, tagged_send)
                return
            log.error("internal error; request id %s", rid, exc_info=exc)
            if started:  # too late for a status: the server ends the connection
                raise
            body = internal_error(rid)
            error = (
                error_response(500, "internal_error", body["detail"], path=scope["path"])
                if is_openai_path(scope["path"])
                else JSONResponse(body, status_code=500)
            )
            await error(scope, receive, tagged_send)
