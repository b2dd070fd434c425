"""The HTTP layer (actors/http/routes.py) with FastAPI's TestClient and a scripted answer
service."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
import traceback
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.routes import MAX_BODY_BYTES, build_http_app, parse_api_keys
from selfrag.schemas.answer import MAX_QUESTION_CHARS, AnswerResponse
from selfrag.schemas.errors import DeadlineExceeded, DependencyDown, Overloaded
from tests.fakes import ScriptedCritic
from tests.http_fakes import SERVED, FakeService, live_server, metric_value
from tests.serve_fakes import Pool, Rig, make_service


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def client(service: FakeService) -> TestClient:
    metrics = Metrics()
    service.metrics = metrics
    return TestClient(build_http_app(service, metrics))


def test_answer_round_trip_uses_request_dials(client: TestClient, service: FakeService):
    r = client.post(
        "/v1/answer",
        json={"question": "Who founded Normandy?", "config": {"mode": "always", "top_k": 5}},
    )
    assert r.status_code == 200, r.text
    body = AnswerResponse.model_validate(r.json())
    assert body.segments[0].citation.passage_id == "p1"
    assert body.config.top_k == 5 and body.config.mode == "always"
    assert r.headers["x-cache"] == "miss"
    assert service.seen[0].config.top_k == 5
    # A mapping dial: each corpus file's own support threshold.
    own = {"squad_v2_small.json": 0.3}
    r = client.post(
        "/v1/answer",
        json={
            "question": "Who founded Normandy?",
            "config": {"min_support_score_by_corpus": own},
        },
    )
    assert r.status_code == 200, r.text
    assert service.seen[-1].config.min_support_score_by_corpus == own


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"question": "x" * (MAX_QUESTION_CHARS + 1)}, "question"),
        ({"question": "q", "colour": "blue"}, "colour"),
        ({"question": "q", "config": {"top_k": 0}}, "config.top_k"),
        ({"question": "q", "config": {"beam_width": 2}}, "config.beam_width"),
        (
            {"question": "q", "config": {"min_support_score_by_corpus": {"a.json": 2}}},
            "config.min_support_score_by_corpus.a.json",
        ),
        (
            {"question": "q", "config": {"min_support_score_by_corpus": [0.2]}},
            "config.min_support_score_by_corpus",
        ),
        ({"question": "   "}, "question"),
        ({"question": "\u200b\x00\u202e\x1b\u3164"}, "question"),
        ({}, "question"),
    ],
)
def test_validation_errors_are_422_naming_the_field(client: TestClient, payload, field):
    r = client.post("/v1/answer", json=payload)
    assert r.status_code == 422
    body = r.json()
    assert body["error"] == "invalid_request"
    assert field in [d["field"] for d in body["detail"]], body


def test_bad_json_is_422(client: TestClient):
    r = client.post(
        "/v1/answer", content=b'{"question": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 422
    assert r.json()["error"] == "invalid_request"
    assert r.json()["detail"][0]["type"] == "json_invalid"


def test_oversized_body_is_413(client: TestClient):
    r = client.post(
        "/v1/answer", content=b"x" * 70_000, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert r.json()["error"] == "payload_too_large"


@pytest.mark.parametrize(
    ("exc", "status", "slug"),
    [
        (Overloaded("busy"), 503, "overloaded"),
        (DependencyDown("pool gone"), 503, "dependency_unavailable"),
        (DeadlineExceeded("too slow"), 504, "deadline_exceeded"),
    ],
)
def test_service_errors_map_to_status_and_json(service, client, exc, status, slug):
    service.fail = exc
    r = client.post("/v1/answer", json={"question": "q"})
    assert r.status_code == status
    assert r.json() == {"error": slug, "detail": exc.detail}
    # The stream reports the same status when it fails before its first event.
    r = client.post("/v1/answer/stream", json={"question": "q"})
    assert r.status_code == status and r.json()["error"] == slug


def test_unknown_route_is_json_404(client: TestClient):
    r = client.get("/v2/nothing")
    assert r.status_code == 404
    assert r.json()["error"] == "not_found"


def _events(text: str) -> list[tuple[str, dict]]:
    """The SSE events of a stream; comment blocks (`: keep-alive`) as ("comment", {})."""
    out: list[tuple[str, dict]] = []
    for block in text.strip().split("\n\n"):
        if block.startswith(":"):
            out.append(("comment", {}))
            continue
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_stream_sends_each_segment_then_the_answer(client: TestClient):
    with client.stream("POST", "/v1/answer/stream", json={"question": "Who?"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = _events(text)
    assert [e for e, _ in events] == ["segment", "segment", "answer"]
    first, second = events[0][1], events[1][1]
    assert first["index"] == 0 and first["segment"]["citation"]["passage_id"] == "p1"
    assert first["segment"]["s_sup"] == 0.75
    assert second["index"] == 1 and second["segment"]["citation"] is None
    assert AnswerResponse.model_validate(events[2][1]).answer.startswith("Rollo")


def test_health_and_readiness(service: FakeService):
    client = TestClient(build_http_app(service, Metrics(), readiness_ttl_s=0.0))
    assert client.get("/healthz").json() == {"status": "ok"}
    # vLLM's name for it; every response carries its request id once.
    health = client.get("/health")
    assert health.json() == {"status": "ok"}
    assert len(health.headers.get_list("x-request-id")) == 1
    behind_serve = TestClient(build_http_app(service, Metrics(), request_id_header=False))
    assert behind_serve.get("/health").headers.get_list("x-request-id") == []
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True
    service.ready["cache"] = False
    r = client.get("/readyz")
    assert r.status_code == 503
    assert r.json() == {
        "ready": False,
        "checks": {"model": True, "store": True, "cache": False},
        "served": SERVED.model_dump(),
    }


def test_metrics_text_format(client: TestClient, service: FakeService):
    client.post("/v1/answer", json={"question": "q"})
    client.post("/v1/answer", json={"question": ""})
    r = client.get("/metrics")
    assert r.status_code == 200 and service.scrapes == 1
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    answer = {"method": "POST", "path": "/v1/answer"}
    assert metric_value(text, "selfrag_http_requests_total", **answer, status="200") == 1
    assert metric_value(text, "selfrag_http_requests_total", **answer, status="422") == 1
    assert "# TYPE selfrag_http_request_duration_seconds histogram" in text
    seconds = "selfrag_http_request_duration_seconds"
    assert metric_value(text, f"{seconds}_bucket", le="+Inf", path="/v1/answer") == 2
    assert metric_value(text, f"{seconds}_count", path="/v1/answer") == 2
    assert metric_value(text, "selfrag_branches_total", outcome="pruned") == 1
    assert metric_value(text, "selfrag_branches_total", outcome="filtered") == 1
    # Counters only, no ratios: the retrieval rate is retrievals / steps in PromQL.
    assert metric_value(text, "selfrag_retrievals_total") == 1
    assert metric_value(text, "selfrag_decoding_steps_total") == 2
    assert "selfrag_retrieval_rate" not in text
    assert metric_value(text, "selfrag_query_cache_total", outcome="hit") == 0
    # This process's own metrics (prometheus_client's process collector).
    assert metric_value(text, "process_resident_memory_bytes") > 0
    # The engine replicas' batch sizes are not this process's: Ray's export has them.
    assert "selfrag_batch_requests" not in text
    for line in text.splitlines():  # every sample line is `name{labels} number`
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1].replace("+Inf", "inf"))


def test_openapi_documents_the_api(client: TestClient):
    spec = client.get("/openapi.json").json()
    assert {"/v1/answer", "/v1/answer/stream", "/healthz", "/readyz", "/metrics"} <= set(
        spec["paths"]
    )
    assert "AnswerRequest" in spec["components"]["schemas"]
    # Error bodies are documented per status, with the one ErrorBody model.
    assert "ErrorBody" in spec["components"]["schemas"]
    for path in ("/v1/answer", "/v1/answer/stream"):
        responses = spec["paths"][path]["post"]["responses"]
        for status in ("401", "422", "503", "504"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorBody")


def test_api_keys_when_configured(service: FakeService):
    app = build_http_app(service, Metrics(), api_keys=parse_api_keys(" k1, k2 ,"))
    c = TestClient(app)
    assert c.post("/v1/answer", json={"question": "q"}).status_code == 401
    r = c.post("/v1/answer", json={"question": "q"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"
    assert "k1" not in r.text
    ok = c.post("/v1/answer", json={"question": "q"}, headers={"Authorization": "Bearer k2"})
    assert ok.status_code == 200
    assert (
        c.post("/v1/answer", json={"question": "q"}, headers={"X-API-Key": "k1"}).status_code == 200
    )
    assert c.get("/metrics").status_code == 401
    assert c.get("/metrics", headers={"X-API-Key": "k1"}).status_code == 200
    # Probes and the API description stay open for load balancers and clients.
    assert c.get("/healthz").status_code == 200
    assert c.get("/readyz").status_code == 200
    assert c.get("/openapi.json").status_code == 200


def test_auth_is_off_by_default():
    assert parse_api_keys(None) == [] and parse_api_keys(" , ") == []


def test_every_503_carries_retry_after(service: FakeService):
    c = TestClient(build_http_app(service, Metrics(), retry_after_s=7))
    for exc in (Overloaded("busy"), DependencyDown("store gone")):
        service.fail = exc
        for path in ("/v1/answer", "/v1/answer/stream"):
            r = c.post(path, json={"question": "q"})
            assert r.status_code == 503 and r.headers["retry-after"] == "7"
    service.fail = DeadlineExceeded("slow")
    assert "retry-after" not in c.post("/v1/answer", json={"question": "q"}).headers
    service.ready["store"] = False
    r = c.get("/readyz")
    assert r.status_code == 503 and r.headers["retry-after"] == "7"


def test_openapi_shows_the_request_bounds(client: TestClient):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    question = schemas["AnswerRequest"]["properties"]["question"]
    assert question["maxLength"] == MAX_QUESTION_CHARS and question["minLength"] == 1

    def bounds(name: str) -> tuple[float | None, float | None]:
        prop = schemas["DecodingOverrides"]["properties"][name]
        # Optional fields are `anyOf: [{type, bounds}, {type: null}]`.
        typed = next(o for o in prop.get("anyOf", [prop]) if o.get("type") != "null")
        low = typed.get("minimum", typed.get("exclusiveMinimum"))
        return low, typed.get("maximum")

    assert bounds("top_k") == (1, 50)
    assert bounds("beam") == (1, 8)
    assert bounds("max_segments") == (1, 32)
    assert bounds("max_segment_tokens") == (4, 512)
    assert bounds("max_retrievals") == (0, 64)
    assert bounds("max_prefill_tokens") == (1, 2_000_000)
    assert bounds("timeout_s") == (0.0, 3600.0)


def test_questions_stay_out_of_info_logs_unless_asked(
    service: FakeService, caplog: pytest.LogCaptureFixture
):
    secret = "What is the launch code of project Nightingale?"
    caplog.set_level("INFO", logger="selfrag.http")
    TestClient(build_http_app(service, Metrics())).post("/v1/answer", json={"question": secret})
    lines = [r.getMessage() for r in caplog.records if r.name == "selfrag.http"]
    assert lines and "answer 200" in lines[-1]
    assert "Nightingale" not in caplog.text and f"<{len(secret)} chars" in lines[-1]
    caplog.clear()
    app = build_http_app(service, Metrics(), log_questions=True)
    TestClient(app).post("/v1/answer", json={"question": secret})
    assert "Nightingale" in caplog.text


def test_api_keys_are_never_logged(service: FakeService, caplog: pytest.LogCaptureFixture):
    caplog.set_level("DEBUG")
    c = TestClient(build_http_app(service, Metrics(), api_keys=parse_api_keys("s3cret-key")))
    c.post("/v1/answer", json={"question": "q"}, headers={"X-API-Key": "s3cret-key"})
    c.post("/v1/answer", json={"question": "q"}, headers={"Authorization": "Bearer wrong-key"})
    assert "s3cret-key" not in caplog.text and "wrong-key" not in caplog.text


# --- streams: keep-alive, late errors, clients that go away ------------------------------------


def test_a_slow_stream_sends_keep_alives_before_its_first_event(service: FakeService):
    service.delay_s = 0.35
    c = TestClient(build_http_app(service, Metrics(), keepalive_s=0.1))
    with c.stream("POST", "/v1/answer/stream", json={"question": "Who?"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    kinds = [k for k, _ in _events(text)]
    assert text.startswith(": keep-alive\n\n")
    assert kinds.count("comment") >= 2
    assert [k for k in kinds if k != "comment"] == ["segment", "segment", "answer"]


def test_a_failure_after_the_stream_started_is_an_error_event(service: FakeService):
    service.delay_s = 0.25
    service.fail = DeadlineExceeded("no answer within timeout_s=0.2")
    c = TestClient(build_http_app(service, Metrics(), keepalive_s=0.1))
    with c.stream("POST", "/v1/answer/stream", json={"question": "Who?"}) as r:
        assert r.status_code == 200  # a keep-alive went out before the failure
        text = "".join(r.iter_text())
    events = _events(text)
    assert events[0][0] == "comment"
    assert events[-1] == (
        "error",
        {"error": "deadline_exceeded", "detail": service.fail.detail, "status": 504},
    )


@pytest.fixture
def hung_rig() -> Iterator[Rig]:
    """The real answer service over fake deployments whose pool never finishes a draft
    (until the test ends): a decode that can only end by being cancelled."""
    rig = make_service(max_inflight=1)
    rig.pool.hang = threading.Event()
    yield rig
    rig.pool.hang.set()


def _wait_until(condition, limit_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < limit_s, f"{what} not within {limit_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


STREAM_BODY = {"question": "Who founded Normandy?", "config": {"mode": "never", "timeout_s": 30}}


def _assert_cancelled_and_freed(rig: Rig) -> None:
    # The decoder stops waiting on its (hung) pool call and ends: the slot is free again
    # long before the 30 s deadline, and the abandoned call was cancelled.
    _wait_until(lambda: rig.service.inflight == 0, 3.0, "the in-flight slot freed")
    assert [c.cancelled for c in rig.pool_handle.calls if c.cancelled] == [True]
    assert not rig.pool.hang.is_set()  # nothing but the cancellation ended it
    text = rig.metrics.render()
    assert metric_value(text, "selfrag_inflight_answers") == 0
    assert metric_value(text, "selfrag_streams_abandoned_total") == 1


def test_a_client_gone_before_the_first_event_cancels_its_decode(hung_rig: Rig):
    app = build_http_app(hung_rig.service, hung_rig.metrics, keepalive_s=30)
    body = json.dumps(STREAM_BODY).encode()
    with live_server(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"POST /v1/answer/stream HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            _wait_until(lambda: hung_rig.pool.drafts_started == 1, 5.0, "the decode started")
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):  # not a byte of the response yet
                sock.recv(1)
            assert hung_rig.service.inflight == 1
        _assert_cancelled_and_freed(hung_rig)
        # The slot is usable again: the next stream is admitted (and answers with its
        # status line at once, a keep-alive being due), instead of a 503.
        hung_rig.pool.hang.set()
        with httpx.Client(base_url=url, timeout=10) as c:
            r = c.post("/v1/answer/stream", json={"question": "q", "config": {"mode": "never"}})
        assert r.status_code == 200 and _events(r.text)[-1][0] == "answer"


def test_a_client_gone_mid_stream_cancels_its_decode(hung_rig: Rig):
    app = build_http_app(hung_rig.service, hung_rig.metrics, keepalive_s=0.1)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=5) as c:
        with c.stream("POST", "/v1/answer/stream", json=STREAM_BODY) as r:
            assert r.status_code == 200
            first = next(r.iter_raw())
            assert first == b": keep-alive\n\n"
            assert hung_rig.service.inflight == 1
        # Leaving the block closes the unfinished response's connection.
        _assert_cancelled_and_freed(hung_rig)


# --- the body limit while reading ---------------------------------------------------------------


def test_a_chunked_oversized_body_is_413_over_a_real_socket(service: FakeService):
    def chunks() -> Iterator[bytes]:
        yield b'{"question": "'
        for _ in range(10):
            yield b"x" * 10_000
        yield b'"}'

    with live_server(build_http_app(service, Metrics())) as url, httpx.Client(base_url=url) as c:
        r = c.post("/v1/answer", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in {k.lower() for k in r.request.headers}
        assert r.status_code == 413, r.text
        assert r.json()["error"] == "payload_too_large"
        small = c.post("/v1/answer", json={"question": "q"})
        assert small.status_code == 200
    assert len(service.seen) == 1  # the oversized request never reached the service


def test_the_body_limit_stops_reading_at_the_limit(service: FakeService):
    """A body without Content-Length is read only until it passes the limit."""
    app = build_http_app(service, Metrics())
    chunk = 16 * 1024
    pulled = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"x" * chunk, "more_body": pulled < 1000}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/answer",
        "raw_path": b"/v1/answer",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert pulled == MAX_BODY_BYTES // chunk + 1
    assert json.loads(sent[1]["body"])["error"] == "payload_too_large"


# --- internal errors and request ids ------------------------------------------------------------


def test_an_internal_error_is_generic_with_a_request_id_that_the_log_explains(
    service: FakeService, caplog: pytest.LogCaptureFixture
):
    service.fail = RuntimeError("connection string postgres://admin:hunter2@db")
    caplog.set_level("ERROR", logger="selfrag.http")
    c = TestClient(build_http_app(service, Metrics()), raise_server_exceptions=False)
    r = c.post("/v1/answer", json={"question": "q"})
    assert r.status_code == 500
    rid = r.headers["x-request-id"]
    assert r.json() == {
        "error": "internal_error",
        "detail": f"internal error; request id {rid}",
        "request_id": rid,
    }
    assert "hunter2" not in r.text and "RuntimeError" not in r.text
    (record,) = [x for x in caplog.records if rid in x.getMessage()]
    assert record.exc_info is not None and "hunter2" in caplog.text  # the detail is logged

    # The stream: at once, a 500 with the same generic body; after it started, an event.
    r = c.post("/v1/answer/stream", json={"question": "q"})
    rid = r.headers["x-request-id"]
    assert r.status_code == 500 and r.json()["detail"] == f"internal error; request id {rid}"
    service.delay_s = 0.2
    c = TestClient(build_http_app(service, Metrics(), keepalive_s=0.05))
    r = c.post("/v1/answer/stream", json={"question": "q"})
    rid = r.headers["x-request-id"]
    assert r.status_code == 200 and "hunter2" not in r.text
    assert _events(r.text)[-1] == (
        "error",
        {
            "error": "internal_error",
            "detail": f"internal error; request id {rid}",
            "request_id": rid,
            "status": 500,
        },
    )
    assert any(rid in x.getMessage() and x.exc_info for x in caplog.records)


def test_every_response_carries_a_request_id(client: TestClient):
    responses = [
        client.get("/healthz"),
        client.get("/readyz"),
        client.get("/metrics"),
        client.get("/nothing"),
        client.post("/v1/answer", json={"question": "q"}),
        client.post("/v1/answer", json={}),
        client.post("/v1/answer", content=b"x" * 70_000),
        client.post("/v1/answer/stream", json={"question": "q"}),
    ]
    ids = [r.headers.get("x-request-id") for r in responses]
    assert all(i and re.fullmatch(r"[0-9a-f]{32}", i) for i in ids), ids
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("req-42.a:b_C", True),
        ("x" * 128, True),
        ("x" * 129, False),
        ("two words", False),
        ("id\u00e9", False),
        ("<script>", False),
        ("", False),
    ],
)
def test_a_sane_incoming_request_id_is_kept(client: TestClient, given: str, kept: bool):
    r = client.get("/healthz", headers={"X-Request-Id": given.encode("utf-8")})
    assert (r.headers["x-request-id"] == given) is kept
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", r.headers["x-request-id"])


def test_a_failed_readiness_check_does_not_show_its_exception(
    service: FakeService, caplog: pytest.LogCaptureFixture
):
    service.ready_error = ConnectionError("redis://:s3cret@cache:6379 refused")
    caplog.set_level("WARNING", logger="selfrag.http")
    r = TestClient(build_http_app(service, Metrics())).get("/readyz")
    assert r.status_code == 503 and r.json()["error"] == "not_ready"
    assert "s3cret" not in r.text and "ConnectionError" not in r.text
    assert r.headers["x-request-id"] in r.json()["detail"]
    assert "s3cret" in caplog.text


class LeakyPool(Pool):
    """A pool whose drafting fails with a ValueError naming a server folder."""

    def expand(self, source, candidates, cfg, timeout_s):  # type: ignore[no-untyped-def]
        raise ValueError("tensor shape mismatch in /srv/selfrag/home/models/derived.gguf")


def test_a_deployments_value_error_is_a_generic_500_not_a_422(
    caplog: pytest.LogCaptureFixture,
):
    """Only what the request validation decides is a 4xx; a deployment's ValueError is not
    the client's fault, and its message stays in the log."""
    rig = make_service(pool=LeakyPool(ScriptedCritic(relevance_of={"p1": 0.9})))
    caplog.set_level("ERROR", logger="selfrag.http")
    c = TestClient(build_http_app(rig.service, rig.metrics), raise_server_exceptions=False)
    body = {"question": "q", "config": {"mode": "never"}}
    r = c.post("/v1/answer", json=body)
    assert r.status_code == 500, r.text
    rid = r.headers["x-request-id"]
    assert r.json()["detail"] == f"internal error; request id {rid}"
    r = c.post(
        "/v1/chat/completions",
        json={
            "model": "selfrag",
            "messages": [{"role": "user", "content": "q"}],
            "selfrag": {"mode": "never"},
        },
    )
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "/srv/selfrag" not in r.text
    logged = [
        x
        for x in caplog.records
        if x.exc_info and "derived.gguf" in "".join(traceback.format_exception(*x.exc_info))
    ]
    assert len(logged) == 2  # each failure logged once, with its detail
    # A critique source this model lacks is the request's choice: a 422 saying so.
    r = c.post("/v1/answer", json={"question": "q", "config": {"critique": "native"}})
    assert r.status_code == 422 and "native" in r.json()["detail"]
