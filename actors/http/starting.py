"""While `selfrag serve` starts, its port answers every request with 503 and `Retry-After`
instead of refusing connections, so a load balancer or client retries rather than failing.

`StartingResponder` holds the port from the moment the command has checked it is free until
just before Serve's proxy binds it; it changes no state and serves no data, only the error
body the app itself gives a request it cannot answer yet (OpenAI's envelope on OpenAI routes).
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NOT_READY = "not_ready"
# A request body is read (up to this much) before the answer, so the client is not cut off
# mid-send; more than this and the connection is closed after the answer.
READ_LIMIT = 1 << 20


def starting_body(path: str, retry_after_s: int) -> bytes:
    """The JSON error body for `path` while the server starts."""
    # Imported at the first request, not before the port is held: the responder opens first
    # thing in `selfrag serve`, ahead of the imports that take seconds.
    from selfrag.actors.http.openai_routes import is_openai_path
    from selfrag.schemas.errors import ErrorBody
    from selfrag.schemas.openai import OpenAIErrorBody, OpenAIErrorDetail

    detail = f"the server is starting; retry after {retry_after_s} s"
    if is_openai_path(path):
        body: ErrorBody | OpenAIErrorBody = OpenAIErrorBody(
            error=OpenAIErrorDetail(message=detail, type="server_error", code=NOT_READY)
        )
    else:
        body = ErrorBody(error=NOT_READY, detail=detail)
    return json.dumps(body.model_dump(mode="json")).encode()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = 10  # a client that sends nothing does not hold a thread

    def _answer(self) -> None:
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and int(length) <= READ_LIMIT:
            self.rfile.read(int(length))
        body = starting_body(self.path.split("?", 1)[0], self.server.retry_after_s)
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Retry-After", str(self.server.retry_after_s))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _answer

    def log_message(self, format: str, *args: object) -> None:
        """Silent: these requests are expected and retried."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, retry_after_s: int) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.retry_after_s = retry_after_s
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own looks the host's name up (reverse DNS), which can stall for seconds.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


class StartingResponder:
    """Answers 503 with `Retry-After` on `host:port` from `open()` until `close()`."""

    def __init__(self, host: str, port: int, retry_after_s: int) -> None:
        self.host = host
        self.port = port
        self.retry_after_s = retry_after_s
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def open(self) -> bool:
        """Bind and answer; False (nothing held) when the port cannot be bound."""
        try:
            self._server = _Server(self.host, self.port, self.retry_after_s)
        except OSError:
            return False
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="selfrag-starting",
            daemon=True,
        )
        self._thread.start()
        return True

    def close(self) -> None:
        """Stop answering and free the port (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
