"""The Ray Serve application for real: SmolLM2 through llama.cpp, embedded Qdrant, HTTP.

Ray and the app start once for this module (`ray_session`, `api`), and Ray stops after it: a
live instance would be what `--address auto` finds in later modules' tests. Requests
are kept small (one segment, two passages) so the whole module stays within a few minutes
on two cores.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from selfrag.infra.settings_loader import load_settings
from tests.browser import CHROMIUM, NO_CHROMIUM, ask_in_playground, chromium
from tests.paths import ROOT
from tests.redis_proc import RedisProcess, free_port
from tests.suite import SUITE_ENV

pytestmark = pytest.mark.real

SMALL = {"mode": "always", "top_k": 2, "max_segments": 1, "max_segment_tokens": 16}
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[int]:
    """A local Ray instance on loopback with Serve's HTTP proxy; yields the HTTP port."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def redis_for_app() -> Iterator[RedisProcess | None]:
    """A redis-server of our own for the app's query cache (None without the binary)."""
    binary = shutil.which("redis-server")
    proc = RedisProcess(binary, free_port()) if binary else None
    if proc is not None:
        proc.start()
    yield proc
    if proc is not None:
        proc.kill()


@pytest.fixture(scope="module")
def api(
    ray_session: int, indexed_home: Path, redis_for_app: RedisProcess | None
) -> Iterator[httpx.Client]:
    from ray import serve

    from selfrag.actors.serve_app import APP_NAME, build_app

    env = {"SELFRAG_HOME": str(indexed_home), **SUITE_ENV}
    if redis_for_app is not None:
        env |= {"SELFRAG_REDIS_URL": redis_for_app.url, "SELFRAG_CACHE__REDIS_RETRY_S": "1"}
    settings = load_settings(environ=env)
    serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
    with httpx.Client(base_url=f"http://127.0.0.1:{ray_session}", timeout=180) as client:
        yield client
    # Frees the embedded Qdrant folder for other modules.
    serve.delete(APP_NAME)


def _metric(text: str, name: str) -> dict[str, float]:
    """`{labels: value}` for every sample of `name`."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def _exported(text: str, name: str, **labels: str) -> dict[tuple[str, str], float]:
    """The samples `name` of Ray's metrics export whose labels include `labels`, keyed by
    (replica, method)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                out[(s.labels.get("replica", ""), s.labels.get("method", ""))] = s.value
    return out


def _exported_labels(text: str, deployment: str) -> list[dict[str, str]]:
    """The label sets of every selfrag series `deployment`'s replicas export."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        s.labels
        for family in text_string_to_metric_families(text)
        if family.name.startswith("ray_selfrag_")
        for s in family.samples
        if s.labels.get("deployment") == deployment
    ]


def _ray_metrics(until: Callable[[str], bool], limit_s: float = 90.0) -> str:
    """This node's metrics as Ray's metrics agent exports them to Prometheus (the port Ray
    chose, `MetricsExportPort`), polled until `until` holds: replicas report every few
    seconds."""
    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    deadline = time.monotonic() + limit_s
    while True:
        text = httpx.get(url, timeout=10).text
        if until(text):
            return text
        assert time.monotonic() < deadline, f"not in Ray's export within {limit_s:.0f} s: {url}"
        time.sleep(1.0)


def _replica_log_has(deployment: str, needle: str, limit_s: float = 10.0) -> bool:
    """Whether a Serve replica log file of `deployment` holds `needle` (polled briefly)."""
    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()  # no public accessor
    pattern = os.path.join(logs, "serve", f"replica_*{deployment}*.log")
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for path in glob.glob(pattern):
            with open(path, errors="replace") as f:
                if needle in f.read():
                    return True
        time.sleep(0.5)
    return False


def test_readiness_and_health(api: httpx.Client, indexed_home: Path):
    from selfrag.infra.home_identity import home_id

    assert api.get("/healthz").json() == {"status": "ok"}
    health = api.get("/health", headers={"X-Request-Id": "probe-1"})
    assert health.json() == {"status": "ok"}
    # Serve's proxy echoes the request id; the app adds no second one.
    assert health.headers.get_list("x-request-id") == ["probe-1"]
    r = api.get("/readyz")
    assert r.status_code == 200, r.text
    # What is served: the Retriever's home and collection.
    assert r.json() == {
        "ready": True,
        "checks": {"model": True, "store": True, "cache": True},
        "served": {"home_id": home_id(indexed_home), "collection": "passages"},
    }
    assert "/v1/answer" in api.get("/openapi.json").json()["paths"]
    # A request naming another home is refused before anything is done for it.
    other = api.post(
        "/v1/answer",
        json={"question": "Who founded Normandy?", "config": SMALL},
        headers={"X-Selfrag-Home": "f" * 32},
    )
    assert other.status_code == 409 and other.json()["error"] == "wrong_home", other.text


def test_retrieval_and_the_settled_config_through_serve(api: httpx.Client):
    """`/v1/retrieve` reads relevance on the pool and drafts nothing; `/v1/config` is the
    config an answer gets, settled with the pool's facts (`auto` is the source it stands
    for, every filter filled)."""
    question = "Who was the Norse leader who founded Normandy?"
    r = api.post("/v1/retrieve", json={"query": question, "top_k": 2})
    assert r.status_code == 200, r.text
    passages = r.json()["passages"]
    assert len(passages) == 2 and passages[0]["s_rel"] >= passages[1]["s_rel"]
    plain = api.post("/v1/retrieve", json={"query": question, "top_k": 2, "order": "retriever"})
    assert {p["id"] for p in plain.json()["passages"]} == {p["id"] for p in passages}
    assert all(p["s_rel"] is None for p in plain.json()["passages"])
    config = api.post("/v1/config", json={"question": question, "config": SMALL})
    assert config.status_code == 200, config.text
    answer = api.post("/v1/answer", json={"question": question, "config": SMALL}).json()
    assert config.json() == answer["config"]
    assert config.json()["critique"] == "learned" and config.json()["min_support_score"] == 0


def test_documents_are_listed_through_serve_and_a_removal_needs_keys(api: httpx.Client):
    """The documents routes on the real application: the listing comes from the Retriever
    replica's store; with no API keys set, a removal (it changes the index) is refused."""
    listed = api.get("/v1/documents")
    assert listed.status_code == 200, listed.text
    docs = listed.json()
    assert docs and all(d["passages"] >= 1 and d["digest"] for d in docs)
    refused = api.delete(f"/v1/documents/{docs[0]['id']}")
    assert refused.status_code == 403, refused.text
    assert api.get("/v1/documents").json() == docs  # nothing was removed


def test_answer_end_to_end_with_the_real_model(api: httpx.Client):
    r = api.post(
        "/v1/answer",
        json={"question": "Who was the Norse leader who founded Normandy?", "config": SMALL},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["answer"].strip()
    # auto: the heads shipped for the embedded default.
    assert body["critique"] == "learned" and "SmolLM2" in body["model_id"]
    assert body["config"]["top_k"] == 2 and body["usage"]["retrievals"] == 1
    cited = [s for s in body["segments"] if s["citation"] is not None]
    if cited:
        assert cited[0]["citation"]["passage_id"] in {p["id"] for p in body["passages"]}
        assert 0.0 <= cited[0]["s_rel"] <= 1.0 and 0.0 <= cited[0]["s_sup"] <= 1.0
    assert body["usage"]["branches_opened"] == 3


def test_invalid_requests_are_422_through_the_proxy(api: httpx.Client):
    bad_json = api.post(
        "/v1/answer", content=b'{"question": "x"', headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 422 and bad_json.json()["error"] == "invalid_request"
    long = api.post("/v1/answer", json={"question": "why? " * 1000})
    assert long.status_code == 422
    assert long.json()["detail"][0]["field"] == "question"
    unknown = api.post("/v1/answer", json={"question": "q", "config": {"temperature": 2.5}})
    assert unknown.status_code == 422
    assert unknown.json()["detail"][0]["field"] == "config.temperature"
    # A cross-site form or text/plain POST, and a rebound DNS name: refused by the ingress,
    # which knows that Serve binds loopback here.
    plain = api.post(
        "/v1/answer", content=b'{"question": "q"}', headers={"content-type": "text/plain"}
    )
    assert plain.status_code == 415 and plain.json()["error"] == "unsupported_media_type"
    rebound = api.get("/readyz", headers={"host": "evil.example"})
    assert rebound.status_code == 421 and rebound.json()["error"] == "misdirected_request"


def test_concurrent_requests_share_engine_batches(api: httpx.Client):
    questions = [
        "Who founded Normandy?",
        "When were the Normans in Normandy?",
        "What language did the Normans speak?",
        "Who was Rollo?",
    ]

    def ask(q: str) -> int:
        return api.post("/v1/answer", json={"question": q, "config": SMALL}).status_code

    with ThreadPoolExecutor(len(questions)) as pool:
        assert list(pool.map(ask, questions)) == [200] * 4
    text = api.get("/metrics").text
    ok = _metric(text, "selfrag_http_requests_total")
    assert ok['{method="POST",path="/v1/answer",status="200"}'] >= len(questions)
    # mode "always": every step retrieved (the ratio is PromQL's, from these two counters).
    steps = _metric(text, "selfrag_decoding_steps_total")[""]
    assert steps >= len(questions) and _metric(text, "selfrag_retrievals_total")[""] == steps
    assert _metric(text, "process_resident_memory_bytes")[""] > 0  # the ingress process's own
    # The pool's batch sizes are not the ingress's: the pool replica exports them itself.
    assert "selfrag_batch_requests" not in text

    branch_pool = {"deployment": "BranchPool", "application": "selfrag"}

    def merged(exported: str) -> bool:
        """Some engine call of a pool replica carried more than one request's calls (Ray
        estimates a histogram's _sum from its buckets: compare the buckets)."""
        single = _exported(exported, "ray_selfrag_batch_requests_bucket", **branch_pool, le="1.0")
        counts = _exported(exported, "ray_selfrag_batch_requests_count", **branch_pool)
        return any(counts[k] > n for k, n in single.items() if k in counts)

    def served(exported: str) -> float:
        ok = {"deployment": "SelfRAGIngress", "path": "/v1/answer", "status": "200"}
        return sum(_exported(exported, "ray_selfrag_http_requests_total", **ok).values())

    # Replicas report every few seconds: wait for both the pool's and the ingress's series.
    exported = _ray_metrics(lambda t: merged(t) and served(t) >= len(questions))
    replicas = {labels["replica"] for labels in _exported_labels(exported, "BranchPool")}
    assert replicas and all(replicas), exported  # tagged with the replica that recorded them
    # The ingress's selfrag log records are in its Serve replica log (serve.log_level INFO).
    assert _replica_log_has("SelfRAGIngress", "answer 200"), "no answer line in the replica log"


def test_stream_sends_segments_then_the_answer(api: httpx.Client):
    events = []
    payload = {"question": "Who was Rollo?", "config": {**SMALL, "max_segments": 2}}
    with api.stream("POST", "/v1/answer/stream", json=payload) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for block in r.read().decode().strip().split("\n\n"):
            if block.startswith(":"):  # a keep-alive comment, sent while a step takes long
                continue
            fields = dict(line.split(": ", 1) for line in block.splitlines())
            events.append((fields["event"], json.loads(fields["data"])))
    kinds = [k for k, _ in events]
    assert kinds[-1] == "answer" and kinds[:-1] and set(kinds[:-1]) == {"segment"}
    final = events[-1][1]
    streamed = {e["index"]: e["segment"] for k, e in events if k == "segment"}
    assert [streamed[i] for i in range(len(final["segments"]))] == final["segments"]


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_the_playground_answers_in_a_browser(api: httpx.Client, tmp_path: Path):
    """The page at `/` in headless Chromium, against this module's app and the real model.
    SELFRAG_UPDATE_SCREENSHOT=1 saves the screenshot as docs/playground.png. (A question the
    suite's SmolLM2 answers with support above the uncalibrated threshold: its README answer,
    "Grimh Mor", abstains here.)"""
    question = "What is the original meaning of the word Norman?"
    with chromium(timeout_s=30) as page:
        shown = ask_in_playground(
            page, str(api.base_url), question, {"mode": "always", "top_k": "2"}, 120.0
        )
        assert shown["error"] == "", shown
        assert shown["segments"] and shown["citations"], shown
        assert {c["id"] for c in shown["citations"]} <= {p["id"] for p in shown["passages"]}
        assert "critique learned" in shown["usage"] and "SmolLM2" in shown["usage"]
        update = os.environ.get("SELFRAG_UPDATE_SCREENSHOT") == "1"
        shot = page.screenshot(DOCS / "playground.png" if update else tmp_path / "playground.png")
    assert shot.read_bytes().startswith(b"\x89PNG")


def test_openai_clients_get_answers_with_citations(api: httpx.Client):
    """The official `openai` client and LangChain's `ChatOpenAI` against the real app."""
    import openai
    from langchain_openai import ChatOpenAI

    base = str(api.base_url).rstrip("/") + "/v1"
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=180)
    assert [m.id for m in client.models.list()] == ["selfrag"]
    messages = [
        {"role": "user", "content": "Tell me about Normandy."},
        {"role": "assistant", "content": "It is a region of France."},
        {"role": "user", "content": "Who was the Norse leader who founded it?"},
    ]
    r = client.chat.completions.create(
        model="selfrag", messages=messages, max_tokens=16, extra_body={"selfrag": SMALL}
    )
    extension = r.choices[0].model_extra["selfrag"]
    assert r.choices[0].message.content == extension["answer"]
    assert extension["question"].endswith("Question: Who was the Norse leader who founded it?")
    assert extension["config"]["top_k"] == 2 and extension["usage"]["retrievals"] == 1
    assert r.usage.prompt_tokens == extension["usage"]["prefill_tokens"] > 0
    chunks = list(
        client.chat.completions.create(
            model="selfrag",
            messages=[{"role": "user", "content": "Where is Normandy?"}],
            stream=True,
            extra_body={"selfrag": SMALL},
        )
    )
    closing = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    answer = closing.choices[0].model_extra["selfrag"]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer["answer"]
    if not answer["abstained"]:
        segment = next(
            c.choices[0].model_extra["selfrag"] for c in chunks if c.choices[0].delta.content
        )
        assert segment["segment"] == answer["segments"][0]
    llm = ChatOpenAI(
        model="selfrag",
        base_url=base,
        api_key="unused",
        max_retries=0,
        timeout=180,
        extra_body={"selfrag": SMALL},
    )
    assert llm.invoke("Where is Normandy?").content == answer["answer"]  # a query-cache hit


def test_openai_sampling_seed_and_system_message(api: httpx.Client):
    """OpenAI's sampling parameters and a system message through the official client: a
    seed repeats its answer, a system message reaches the drafts, a stream is a 200."""
    import openai

    base = str(api.base_url).rstrip("/") + "/v1"
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=180)
    question = [{"role": "user", "content": "Who was the Norse leader who founded Normandy?"}]

    def ask(messages: list, **sampling: Any) -> dict:
        r = client.chat.completions.create(
            model="selfrag", messages=messages, extra_body={"selfrag": SMALL}, **sampling
        )
        return r.choices[0].model_extra["selfrag"]

    drawn = {"temperature": 0.7, "top_p": 0.9, "seed": 1}
    first = ask(question, **drawn)
    assert first["config"]["temperature"] == 0.7 and first["config"]["seed"] == 1
    assert ask(question, **drawn)["answer"] == first["answer"]
    steered = ask([{"role": "system", "content": "Answer in French."}, *question])
    assert steered["config"]["instructions"] == "Answer in French."
    chunks = list(
        client.chat.completions.create(
            model="selfrag",
            messages=question,
            stream=True,
            extra_body={"selfrag": SMALL},
            **drawn,
        )
    )
    closing = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert closing.choices[0].model_extra["selfrag"]["answer"] == first["answer"]


def test_repeated_query_is_a_cache_hit_and_redis_down_still_answers(
    api: httpx.Client, redis_for_app: RedisProcess | None
):
    payload = {"question": "What is the capital of Normandy?", "config": SMALL}
    first = api.post("/v1/answer", json=payload)
    assert first.status_code == 200 and first.headers["x-cache"] == "miss"
    second = api.post("/v1/answer", json=payload)
    assert second.status_code == 200 and second.headers["x-cache"] == "hit"
    assert second.json() == first.json()
    if redis_for_app is None:
        pytest.skip("no redis-server binary: the Redis outage part needs one to kill")
    text = api.get("/metrics").text
    assert _metric(text, "selfrag_query_cache_tier_total")['{event="redis_put"}'] >= 1

    redis_for_app.kill()
    down = {"question": "Who ruled Normandy after Rollo?", "config": SMALL}
    r = api.post("/v1/answer", json=down)
    assert r.status_code == 200 and r.json()["answer"].strip()
    assert api.post("/v1/answer", json=down).headers["x-cache"] == "hit"  # the memory tier
    ready = api.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["cache"] is False
    tiers = _metric(api.get("/metrics").text, "selfrag_query_cache_tier_total")
    assert tiers['{event="redis_error"}'] >= 1

    redis_for_app.start()
    time.sleep(1.1)  # past cache.redis_retry_s
    assert api.get("/readyz").status_code == 200


def test_redis_stopped_and_restarted_under_concurrent_load(
    api: httpx.Client, redis_for_app: RedisProcess | None
):
    """Four clients keep asking while Redis is SIGKILLed and started again: every request is
    answered (200), questions first asked during the outage too, and answers reach Redis again
    once it is back."""
    if redis_for_app is None:
        pytest.skip("no redis-server binary: this test needs one to kill")
    import redis

    pool = ["Who was the first Duke of Normandy?", "What language did the Normans speak?"]
    statuses: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(base_url=api.base_url, timeout=180) as c:
            n = i
            while not stop.is_set():
                r = c.post("/v1/answer", json={"question": pool[n % len(pool)], "config": SMALL})
                n += 1
                with lock:
                    statuses.append(r.status_code)

    def tier(*events: str) -> float:
        counts = _metric(api.get("/metrics").text, "selfrag_query_cache_tier_total")
        return sum(counts[f'{{event="{e}"}}'] for e in events)

    with ThreadPoolExecutor(4) as ex:
        clients = [ex.submit(client, i) for i in range(4)]
        try:
            time.sleep(2.0)
            failures = tier("redis_error", "redis_bypassed")
            redis_for_app.kill()
            during = api.post("/v1/answer", json={"question": "Where is Bayeux?", "config": SMALL})
            assert during.status_code == 200 and during.json()["answer"].strip()
            redis_for_app.start()
            time.sleep(1.1)  # past cache.redis_retry_s
            puts = tier("redis_put")
            after = api.post(
                "/v1/answer",
                json={"question": "Who founded the Duchy of Normandy?", "config": SMALL},
            )
            assert after.status_code == 200 and after.headers["x-cache"] == "miss"
            time.sleep(1.0)
        finally:
            stop.set()
            for f in clients:
                f.result(timeout=180)
    assert len(statuses) >= 8 and set(statuses) == {200}, statuses
    assert tier("redis_error", "redis_bypassed") > failures  # this outage was seen
    assert tier("redis_put") > puts
    # The restarted (empty) server holds the answer stored after the restart.
    stored = redis.Redis.from_url(redis_for_app.url).keys("selfrag:answer:*")
    assert [k for k in stored if b"~" not in k]  # an answer, not only the byte-cap books
    assert api.get("/readyz").status_code == 200


def _replicas(deployment: str) -> list[str]:
    """Names of the live replica actors of `deployment`."""
    import ray

    # Through this driver's own connection, not the state API, which would have to pick among
    # every Ray instance on the machine.
    named = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in named if f"#{deployment}#" in a["name"]]


def _kill_replica(deployment: str) -> str:
    import ray

    (victim,) = _replicas(deployment)
    ray.kill(ray.get_actor(victim, namespace="serve"))
    return victim


def _assert_clean_failure(r: httpx.Response) -> None:
    """A request that met a dead replica: answered, or a clean 503 (Retry-After) / 504."""
    assert r.status_code in (200, 503, 504), r.text
    if r.status_code == 503:
        assert r.json()["error"] in {"dependency_unavailable", "overloaded"}
        assert r.headers["retry-after"]


def _answers_again(api: httpx.Client, question: str, limit_s: float = 180.0) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        again = api.post("/v1/answer", json={"question": question, "config": SMALL})
        if again.status_code == 200:
            return
        assert again.status_code in (503, 504), again.text
        assert time.monotonic() < deadline, f"no answer {limit_s:.0f} s after the kill"
        time.sleep(2.0)


def test_killed_branch_pool_replica_gives_a_clean_error_then_recovers(api: httpx.Client):
    """`ray.kill` the engine replica while a request is decoding: that request ends with a
    clean 503 (Retry-After) or 504, or succeeds on the restarted replica, never hangs; Serve
    starts a new replica and answers come back."""
    payload = {
        "question": "Which treaty gave Normandy to Rollo?",
        "config": {**SMALL, "max_segments": 2, "timeout_s": 90},
    }
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(api.post, "/v1/answer", json=payload)
        time.sleep(1.0)  # the request is in the decoder by now
        victim = _kill_replica("BranchPool")
        started = time.monotonic()
        r = pending.result(timeout=150)
    assert time.monotonic() - started < 120
    _assert_clean_failure(r)
    _answers_again(api, "Who was Rollo's son?")
    assert victim not in _replicas("BranchPool")
    assert api.get("/readyz").status_code == 200


def test_store_replica_killed_is_not_ready_and_clean_errors_then_recovers(api: httpx.Client):
    """The process that owns the embedded Qdrant store dies: until Serve has restarted it (and
    it has reopened the store), /readyz says the store is down and answers needing retrieval
    end cleanly within their deadline; then everything answers again."""
    victim = _kill_replica("Retriever")
    # ray.kill returns before the process is gone, and a probe may still reach it: probe
    # until the store shows as down (the restarted replica needs seconds to reopen it).
    deadline = time.monotonic() + 30
    while (ready := api.get("/readyz")).status_code == 200:
        assert time.monotonic() < deadline, "the store never showed as down after the kill"
        time.sleep(0.2)
    assert ready.status_code == 503, ready.text
    assert ready.json()["checks"]["store"] is False
    assert ready.headers["retry-after"]
    t0 = time.monotonic()
    r = api.post(
        "/v1/answer",
        json={"question": "Where did the Normans come from?", "config": {**SMALL, "timeout_s": 20}},
    )
    assert time.monotonic() - t0 < 40
    _assert_clean_failure(r)
    _answers_again(api, "Who were the Normans?")
    assert victim not in _replicas("Retriever")
    assert api.get("/readyz").status_code == 200
