"""`actors/http/starting.py`: while `selfrag serve` starts, its port answers 503 with Retry-After in
the app's own error shapes, then frees the port for Serve's proxy."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from selfrag.actors.http.starting import StartingResponder
from tests.redis_proc import free_port


@pytest.fixture
def responder() -> Iterator[StartingResponder]:
    port = free_port()
    starting = StartingResponder("127.0.0.1", port, retry_after_s=3)
    assert starting.open()
    yield starting
    starting.close()


def test_every_route_and_method_answers_503_with_retry_after(responder: StartingResponder):
    base = f"http://127.0.0.1:{responder.port}"
    with httpx.Client(base_url=base, timeout=5) as client:
        for method, path in (("GET", "/readyz"), ("GET", "/health"), ("DELETE", "/v1/documents/x")):
            r = client.request(method, path)
            assert r.status_code == 503 and r.headers["retry-after"] == "3"
            assert r.json() == {
                "error": "not_ready",
                "detail": "the server is starting; retry after 3 s",
                "request_id": None,
            }
        r = client.post("/v1/answer", json={"question": "Who? " * 1000})
        assert r.status_code == 503 and r.json()["error"] == "not_ready"
        head = client.head("/v1/answer")
        assert head.status_code == 503 and head.content == b""


def test_openai_routes_get_openai_s_envelope(responder: StartingResponder):
    r = httpx.post(
        f"http://127.0.0.1:{responder.port}/v1/chat/completions?x=1",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        timeout=5,
    )
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "not_ready"
    assert r.json()["error"]["type"] == "server_error"


def test_close_frees_the_port_for_the_next_holder(responder: StartingResponder):
    responder.close()
    responder.close()  # idempotent
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{responder.port}/readyz", timeout=2)
    with socket.socket() as s:  # as Serve's proxy binds it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", responder.port))


def test_a_port_in_use_is_not_held():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        starting = StartingResponder("127.0.0.1", held.getsockname()[1], retry_after_s=1)
        assert not starting.open()
        starting.close()
