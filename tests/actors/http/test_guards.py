"""The HTTP app's guards (actors/http/guards.py and the app's outer layer): JSON-only POSTs, the
Host check of a loopback server, request metrics whose series a client cannot multiply,
bodies the JSON parser refuses, and one readiness check per second however many ask."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from selfrag.actors.http.guards import HostCheck, host_name
from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.routes import build_http_app
from selfrag.schemas.health import Health
from tests.http_fakes import FakeService, live_server

BODY = json.dumps({"question": "Who founded Normandy?"}).encode()
OPENAI_BODY = json.dumps({"model": "selfrag", "prompt": "Who founded Normandy?"}).encode()


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def client(service: FakeService) -> TestClient:
    return TestClient(build_http_app(service, Metrics()))


# --- POST bodies must be declared JSON ----------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/answer", "/v1/answer/stream", "/v1/completions"])
@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "text/plain; charset=utf-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
    ],
)
def test_a_post_not_declared_json_is_415(
    client: TestClient, service: FakeService, path: str, content_type: str | None
):
    """A web page can POST these content types cross-site without a preflight."""
    body = OPENAI_BODY if path == "/v1/completions" else BODY
    headers = {"content-type": content_type} if content_type else {}
    r = client.post(path, content=body, headers=headers)
    assert r.status_code == 415, r.text
    if path == "/v1/completions":  # in the route family's error shape
        error = r.json()["error"]
        assert error["code"] == "unsupported_media_type"
        assert error["type"] == "invalid_request_error"
        assert "application/json" in error["message"]
    else:
        assert r.json()["error"] == "unsupported_media_type"
        assert "Content-Type must be application/json" in r.json()["detail"]
    assert service.seen == []


@pytest.mark.parametrize("path", ["/v1/answer", "/v1/answer/stream", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=UTF-8"])
def test_a_post_declared_json_is_answered(client: TestClient, path: str, content_type: str):
    body = (
        json.dumps({"model": "selfrag", "messages": [{"role": "user", "content": "q"}]}).encode()
        if path == "/v1/chat/completions"
        else BODY
    )
    r = client.post(path, content=body, headers={"content-type": content_type})
    assert r.status_code == 200, r.text


# --- the Host check of a loopback server --------------------------------------------------------


def test_host_names_are_compared_without_port_case_or_brackets():
    assert [host_name(h) for h in ("LocalHost:8000", "[::1]:80", "::1", "a.example.", "")] == [
        "localhost",
        "::1",
        "::1",
        "a.example",
        "",
    ]
    assert HostCheck.for_bind("0.0.0.0") is None and HostCheck.for_bind("10.1.2.3") is None
    assert HostCheck.for_bind(None) is None
    assert HostCheck.for_bind("127.0.0.1", ["*"]) is None
    check = HostCheck.for_bind("127.0.0.2", ["rag.internal"])
    assert check is not None and check.refusal(None) is None  # HTTP/1.0: no Host at all
    for ok in (b"127.0.0.2:8000", b"localhost", b"[::1]:8000", b"RAG.internal:1"):
        assert check.refusal(ok) is None, ok
    assert check.refusal(b"127.0.0.3") is not None


@pytest.mark.parametrize("bind", ["127.0.0.1", "localhost", "::1"])
def test_a_loopback_server_refuses_a_host_that_is_not_its_own(service: FakeService, bind: str):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 reaches the
    server with `Host: evil.example`."""
    app = build_http_app(service, Metrics(), bind_host=bind, allowed_hosts=["rag.internal"])
    c = TestClient(app)
    for host in ("127.0.0.1:8000", "localhost", "localhost:8000", "[::1]:8000", "rag.internal"):
        assert c.get("/healthz", headers={"host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io"):
        r = c.get("/readyz", headers={"host": host})
        assert r.status_code == 421, host
        assert r.json()["error"] == "misdirected_request"
        assert "serve.allowed_hosts" in r.json()["detail"]
        r = c.post(
            "/v1/answer", content=BODY, headers={"host": host, "content-type": "application/json"}
        )
        assert r.status_code == 421
    r = c.post(
        "/v1/completions",
        content=OPENAI_BODY,
        headers={"host": "evil.example", "content-type": "application/json"},
    )
    assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request"
    assert service.seen == []


def test_a_server_on_another_address_takes_any_host(service: FakeService):
    for bind in ("0.0.0.0", None):
        c = TestClient(build_http_app(service, Metrics(), bind_host=bind))
        assert c.get("/healthz", headers={"host": "rag.example.com"}).status_code == 200
    star = build_http_app(service, Metrics(), bind_host="127.0.0.1", allowed_hosts=["*"])
    assert TestClient(star).get("/healthz", headers={"host": "a.example"}).status_code == 200


def test_the_host_check_over_a_real_socket(service: FakeService):
    app = build_http_app(service, Metrics(), bind_host="127.0.0.1")
    with live_server(app) as url:
        assert httpx.get(url + "/healthz").status_code == 200  # Host: 127.0.0.1:<port>
        r = httpx.get(url + "/healthz", headers={"host": "evil.example"})
        assert r.status_code == 421


# --- request metrics: bounded series ------------------------------------------------------------


def _request_series(metrics: Metrics) -> int:
    return sum(
        1
        for line in metrics.render().splitlines()
        if line.startswith("selfrag_http_requests_total{")
    )


def test_made_up_methods_and_paths_add_a_bounded_number_of_series(service: FakeService):
    metrics = Metrics()
    c = TestClient(build_http_app(service, metrics))
    c.get("/healthz")
    before = _request_series(metrics)
    for i in range(200):
        assert c.request(f"BREW{i}", "/v1/answer").status_code == 405
        assert c.request(f"BREW{i}", f"/nothing/{i}").status_code == 404
        assert c.get(f"/nothing/{i}").status_code == 404
    # (other, /v1/answer, 405), (other, unmatched, 404), (GET, unmatched, 404)
    assert _request_series(metrics) - before == 3
    text = metrics.render()
    assert 'method="other",path="unmatched",status="404"' in text
    assert "BREW" not in text and "/nothing" not in text


# --- JSON the parser refuses --------------------------------------------------------------------

DEEP = b'{"question": "q", "config": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
HUGE_INT = b'{"question": "q", "config": {"top_k": ' + b"9" * 5_000 + b"}}"


@pytest.mark.parametrize("body", [DEEP, HUGE_INT], ids=["deeply-nested", "huge-integer"])
def test_native_routes_refuse_json_they_cannot_read_with_400(
    client: TestClient, body: bytes, caplog: pytest.LogCaptureFixture
):
    caplog.set_level("INFO")
    for path in ("/v1/answer", "/v1/answer/stream"):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == "bad_request"
    assert not [x for x in caplog.records if x.exc_info or x.levelname == "ERROR"]


# --- /readyz: one check per second --------------------------------------------------------------


class CountedReadiness(FakeService):
    """Readiness that takes 50 ms and counts its runs."""

    checks: int = 0

    async def health(self) -> Health:
        self.checks += 1
        await asyncio.sleep(0.05)
        return await super().health()


async def _flood(url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        return await asyncio.gather(*(c.get("/readyz") for _ in range(n)))


def test_a_flood_of_readyz_runs_one_check_per_second():
    service = CountedReadiness()
    with live_server(build_http_app(service, Metrics())) as url:
        started = time.monotonic()
        answers = asyncio.run(_flood(url, 60))
        elapsed = time.monotonic() - started
    assert [r.status_code for r in answers] == [200] * 60
    # One run answers every call within a second of it, and the concurrent ones share it.
    assert service.checks <= 1 + int(elapsed), (service.checks, elapsed)


def test_a_readiness_result_is_reused_until_it_is_stale():
    service = CountedReadiness()
    c = TestClient(build_http_app(service, Metrics()))  # reused for a second
    assert c.get("/readyz").status_code == 200
    service.ready["store"] = False
    assert c.get("/readyz").status_code == 200 and service.checks == 1
    time.sleep(1.05)
    r = c.get("/readyz")
    assert r.status_code == 503 and r.json()["checks"]["store"] is False
    assert service.checks == 2


def test_a_failing_readiness_check_is_shared_too(caplog: pytest.LogCaptureFixture):
    service = CountedReadiness()
    service.ready_error = ConnectionError("redis://:s3cret@cache:6379 refused")
    c = TestClient(build_http_app(service, Metrics(), readiness_ttl_s=60))
    caplog.set_level("WARNING", logger="selfrag.http")
    for _ in range(5):
        r = c.get("/readyz")
        assert r.status_code == 503 and "s3cret" not in r.text
    assert service.checks == 1
    assert "s3cret" in caplog.text


# --- a request naming a home: only a server of that home acts on it ----------------------------


def test_a_request_naming_another_home_or_collection_is_refused_before_anything_is_done():
    from tests.http_fakes import SERVED

    service = FakeService()
    c = TestClient(build_http_app(service, Metrics(), readiness_ttl_s=0.0))
    body = {"question": "Who founded Normandy?"}
    for headers in (
        {"X-Selfrag-Home": "1" * 32},
        {"X-Selfrag-Collection": "elsewhere"},
        {"X-Selfrag-Home": SERVED.home_id, "X-Selfrag-Collection": "elsewhere"},
    ):
        r = c.post("/v1/answer", json=body, headers=headers)
        assert r.status_code == 409 and r.json()["error"] == "wrong_home", r.text
        assert SERVED.home_id in r.json()["detail"] and "nothing was done" in r.json()["detail"]
    assert service.seen == []
    named = {"X-Selfrag-Home": SERVED.home_id, "X-Selfrag-Collection": SERVED.collection}
    assert c.post("/v1/answer", json=body, headers=named).status_code == 200
    assert c.post("/v1/answer", json=body).status_code == 200  # naming nothing: no check
    # A server that cannot tell what it serves acts on no request that names a home.
    service.served = None
    unsure = c.post("/v1/answer", json=body, headers=named)
    assert unsure.status_code == 503 and unsure.headers["retry-after"]
    service.ready_error = ConnectionError("down")
    assert c.post("/v1/answer", json=body, headers=named).status_code == 503
    assert len(service.seen) == 2
