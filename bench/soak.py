"""Soak test: a bounded mixed load on the HTTP endpoint for a fixed time, from a second process
on loopback.

The mix, per request drawn at random: `/v1/answer` with a question from a small pool (so it
repeats and the query cache answers), `/v1/answer/stream`, a fresh request (a cache miss: a
question not asked before, or once they are used up, an earlier one with a segment budget it has
not been asked with, which is a new cache key), and malformed requests (bad JSON, over-long
question, unknown field, out-of-range dial, oversized body). Every response is classified:

* succeeded: 200 to a valid request (a stream counts when it ends with its `answer` event);
* rejected as designed: 422/413 to a malformed request, 503 with Retry-After to any request
  (under load, or while the server starts or stops), 504 to a valid one;
* dropped: a stream the client closes right after the response headers, before any event
  (the server must cancel its decode; the in-flight gauge must be back at 0 after the run);
* disrupted by design: a request whose time overlaps a deliberate disruption and failed the
  way that disruption fails requests, and only that way (see *Disruptions*);
* failed unexpectedly: anything else (5xx other than 503/504, a 4xx to a valid request, a 200
  to a malformed one, a stream without its answer, a connection error). Must be 0.

Disruptions (`--events`, each `kind@fraction` of the run; default `replica@0.1,restart@0.2,
redis@0.5` when this script starts the server, none with `--url`; the restart comes early so
that the server it starts lives through the middle and last thirds, whose RSS peaks the
report compares: a process that does not span both is left out of that figure):

* `redis`: the query cache's redis-server (this script's own, on a loopback port) is killed
  (SIGKILL) and started again on the same port `--redis-down-s` later. Nothing is excused: an
  outage is bypassed, answers go on.
* `replica`: the engine replica (BranchPool) is killed (SIGKILL, like a crash) and Serve starts
  another. Its window lasts from the kill until `/readyz` is 200 again; within it only a stream
  that ends with its `error` event (the decode it was on died) counts as disrupted; 503 with
  Retry-After and 504 stay "rejected as designed"; a dropped connection is a failure.
* `restart`: the whole `selfrag serve` is stopped as a supervisor stops it (SIGTERM to its
  process group, SIGKILL after 8 s) and started again on the same port. Its window lasts from
  the SIGTERM until the new server's `/readyz` is 200; within it a request that arrived after
  the SIGTERM and met a connection error, a 500 or 502 or a stream cut short counts as
  disrupted (a 503 with Retry-After is rejected as designed). A request in flight at the
  SIGTERM must end with its answer (the stop drains it: `in_flight_at_stop`, `drained`), and
  a 404 is never excused (`not_found`). After the window, the same failures count as failed:
  the new server (not a stale proxy on the port) must answer everything.

Alongside, the resident memory (VmRSS from /proc) of every Ray Serve replica process is
sampled; the report gives each replica's peak, a per-minute series, and its peak in the middle
and last thirds of the run (after warm-up), so growth shows as last ≫ middle.

Without `--url` it starts `selfrag serve` itself (`--home`: an indexed SELFRAG_HOME), in a
process group of its own, with its own redis-server as the query cache when `redis-server` is
on PATH (`--no-redis`: none). The last line holds the figures as `name=value`.

    .venv/bin/python -m bench.soak --home /path/to/indexed/home --duration-s 600
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.disruptions import Disruptions, RedisServer, Server, inject, parse_events
from bench.processes import replica_rss
from bench.serve_load import SMALL_CONFIG, questions


@dataclass
class Tally:
    """Counts and latencies, shared by the client threads (guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: Counter[str] = field(default_factory=Counter)
    outcome: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, outcome: str, seconds: float, why: str = "") -> None:
        with self.lock:
            self.sent[kind] += 1
            self.outcome[outcome] += 1
            if outcome == "succeeded":
                self.latencies.append(seconds)
            if outcome in ("failed", "disrupted"):
                self.failures[f"{outcome} {kind}: {why}"[:160]] += 1


MALFORMED: list[tuple[str, bytes, set[int]]] = [
    ("bad_json", b'{"question": "Who', {422}),
    ("too_long", json.dumps({"question": "why " * 600}).encode(), {422}),
    ("unknown_field", json.dumps({"question": "q", "temperature": 1}).encode(), {422}),
    ("bad_dial", json.dumps({"question": "q", "config": {"top_k": 0}}).encode(), {422}),
    ("huge_body", b'{"question": "' + b"x" * 70_000 + b'"}', {413}),
]


def engine_replica(server_pid: int, deployment: str = "BranchPool") -> int | None:
    """The pid of a live `deployment` replica below `server_pid`."""
    for name in replica_rss(server_pid):  # "app:Deployment[pid]"
        if name.rsplit(":", 1)[-1].startswith(f"{deployment}["):
            return int(name.split("[", 1)[1].rstrip("]"))
    return None


class FreshRequests:
    """An endless supply of valid requests no earlier request shares a cache key with: each
    question in turn, then each again with the next segment budget."""

    def __init__(self, questions: Sequence[str]) -> None:
        self._questions = list(questions)
        self._n = 0
        self._lock = threading.Lock()

    def next(self) -> dict:
        with self._lock:
            n, self._n = self._n, self._n + 1
        rounds, i = divmod(n, len(self._questions))
        config = {**SMALL_CONFIG, "max_segment_tokens": SMALL_CONFIG["max_segment_tokens"] + rounds}
        return {"question": self._questions[i], "config": config}


def one_request(
    client: httpx.Client, rng: random.Random, pool: list[str], fresh: FreshRequests
) -> tuple[str, str, float, str]:
    """Send one request of the mix; (kind, outcome, seconds, why-if-failed)."""
    roll = rng.random()
    start = time.perf_counter()
    try:
        if roll < 0.15:
            name, body, expected = rng.choice(MALFORMED)
            r = client.post(
                "/v1/answer", content=body, headers={"content-type": "application/json"}
            )
            elapsed = time.perf_counter() - start
            # A 503 with Retry-After may come before the body is read (the server is starting
            # or stopping): "come back later" holds for any request.
            later = r.status_code == 503 and "retry-after" in r.headers
            if (r.status_code in expected or later) and "error" in r.json():
                return f"malformed:{name}", "rejected", elapsed, ""
            return f"malformed:{name}", "failed", elapsed, f"HTTP {r.status_code}"
        if roll < 0.22:
            # A client that gives up before the first event: the server must cancel the
            # decode and free its in-flight slot (checked at the end of the run).
            kind = "stream_dropped"
            with client.stream("POST", "/v1/answer/stream", json=fresh.next()) as r:
                status = r.status_code
            elapsed = time.perf_counter() - start
            if status in (200, 503, 504):
                return kind, "dropped", elapsed, ""
            return kind, "failed", elapsed, f"HTTP {status}"
        if roll < 0.35:
            kind = "stream"
            payload = {"question": rng.choice(pool), "config": SMALL_CONFIG}
            with client.stream("POST", "/v1/answer/stream", json=payload) as r:
                text = r.read().decode()
            elapsed = time.perf_counter() - start
            if r.status_code == 200:
                if "event: answer" in text:
                    return kind, "succeeded", elapsed, ""
                if "event: error" in text:
                    return kind, "failed", elapsed, "stream ended with its error event"
                return kind, "failed", elapsed, "stream ended without its answer"
        else:
            kind = "answer_repeat" if roll < 0.85 else "answer_fresh"
            if kind == "answer_repeat":
                payload = {"question": rng.choice(pool), "config": SMALL_CONFIG}
            else:
                payload = fresh.next()
            r = client.post("/v1/answer", json=payload)
            elapsed = time.perf_counter() - start
            if r.status_code == 200 and r.json()["answer"] is not None:
                return kind, "succeeded", elapsed, ""
        if r.status_code in (503, 504):
            if r.status_code == 503 and "retry-after" not in r.headers:
                return kind, "failed", elapsed, "503 without Retry-After"
            return kind, "rejected", elapsed, ""
        return kind, "failed", elapsed, f"HTTP {r.status_code}: {r.text[:80]}"
    except httpx.HTTPError as exc:
        return "transport", "failed", time.perf_counter() - start, f"{type(exc).__name__}: {exc}"


def soak(
    url: str,
    duration_s: float,
    clients: int,
    sample_s: float,
    seed: int,
    server_pid: int | None = None,
    server: Server | None = None,
    redis: RedisServer | None = None,
    events: Sequence[tuple[str, float]] = (),
    redis_down_s: float = 10.0,
) -> dict[str, float]:
    qs = questions(200)
    pool, fresh = qs[:8], FreshRequests(qs[8:] or qs)
    tally = Tally()
    samples: list[tuple[float, dict[str, int]]] = []
    started = time.monotonic()
    stop = threading.Event()
    disruptions = Disruptions()
    counts: Counter[str] = Counter()

    def owner() -> int | None:
        return server.pid if server is not None else server_pid

    def client_loop(i: int) -> None:
        rng = random.Random(seed + i)
        with httpx.Client(base_url=url, timeout=httpx.Timeout(300.0)) as client:
            while not stop.is_set():
                t0 = time.monotonic()
                kind, outcome, seconds, why = one_request(client, rng, pool, fresh)
                t1 = time.monotonic()
                with tally.lock:
                    if disruptions.in_flight_at_stop(t0, t1):
                        counts["in_flight_at_stop"] += 1
                        counts["drained"] += outcome == "succeeded"
                    counts["not_found"] += why.startswith("HTTP 404")
                if outcome == "failed" and disruptions.excused(t0, t1, why):
                    outcome = "disrupted"
                tally.add(kind, outcome, seconds, why)
                if kind == "transport":
                    stop.wait(0.5)  # no server there: a client retries later, not in a spin

    def sampler() -> None:
        while not stop.is_set():
            samples.append((time.monotonic() - started, replica_rss(owner())))
            stop.wait(sample_s)

    def injector() -> None:
        for kind, at in events:
            if stop.wait(max(0.0, started + at * duration_s - time.monotonic())):
                return
            inject(kind, disruptions, server, redis, redis_down_s, counts, engine_replica)

    with ThreadPoolExecutor(clients + 2) as ex:
        ex.submit(sampler)
        injecting = ex.submit(injector)
        futures = [ex.submit(client_loop, i) for i in range(clients)]
        last = started
        while time.monotonic() - started < duration_s:
            time.sleep(1.0)
            if time.monotonic() - last >= 60:
                last = time.monotonic()
                with tally.lock:
                    print(
                        f"  t={last - started:5.0f}s sent={sum(tally.sent.values())} "
                        f"{dict(tally.outcome)}",
                        flush=True,
                    )
        stop.set()
        for f in futures:
            f.result()
        injecting.result()
    samples.append((time.monotonic() - started, replica_rss(owner())))
    figures = report(tally, samples, time.monotonic() - started)
    for line in disruptions.log:
        print(f"disruption {line}")
    figures.update({k: counts[k] for k in ("redis_kills", "replica_kills", "restarts")})
    if counts["restarts"]:
        figures["restart_sigkills"] = counts["restart_sigkills"]
        figures["restart_stop_ms_max"] = counts["restart_stop_ms_max"]
        figures["in_flight_at_stop"] = counts["in_flight_at_stop"]
        figures["drained"] = counts["drained"]
    figures["not_found"] = counts["not_found"]
    inflight, waited = inflight_after(url)
    print(f"in-flight answers after the load: {inflight} (after waiting {waited:.0f} s)")
    figures["dropped_streams"] = tally.outcome["dropped"]
    figures["inflight_end"] = inflight
    return figures


INFLIGHT_METRIC = "selfrag_inflight_answers"


def inflight_after(url: str, wait_s: float = 120.0) -> tuple[int, float]:
    """The ingress's in-flight gauge once the load stopped: it must return to 0 (a dropped
    stream whose decode kept running would hold its slot). Polls until 0 or `wait_s`."""
    start = time.monotonic()
    value = -1
    with httpx.Client(base_url=url, timeout=10.0) as client:
        while True:
            text = client.get("/metrics").text
            for line in text.splitlines():
                if line.startswith(INFLIGHT_METRIC):
                    value = int(float(line.split()[-1]))
            if value == 0 or time.monotonic() - start > wait_s:
                return value, time.monotonic() - start
            time.sleep(2.0)


def report(
    tally: Tally, samples: list[tuple[float, dict[str, int]]], wall: float
) -> dict[str, float]:
    lat = sorted(tally.latencies)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")

    sent = sum(tally.sent.values())
    print(
        f"\nran {wall:.0f} s; requests sent {sent}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(tally.sent.items()))
    )
    print(
        f"succeeded {tally.outcome['succeeded']}, rejected as designed (4xx/503/504) "
        f"{tally.outcome['rejected']}, streams dropped by the client {tally.outcome['dropped']}, "
        f"disrupted by design {tally.outcome['disrupted']}, "
        f"failed unexpectedly {tally.outcome['failed']}"
    )
    for why, n in tally.failures.most_common(10):
        print(f"  failure x{n}: {why}")
    print(f"latency of successes ms: p50 {pct(0.5):.0f}  p95 {pct(0.95):.0f}  p99 {pct(0.99):.0f}")

    # RSS per replica process: peak overall, and peaks of the middle and last thirds.
    series: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for t, rss in samples:
        for name, value in rss.items():
            series[name].append((t, value))
    total_peak = max((sum(r.values()) for _, r in samples), default=0)
    growth = 0.0
    # Middle vs last third: the first third holds the warm-up (model load, caches filling).
    print("replica RSS MiB (peak; middle third peak -> last third peak; per minute):")
    for name, points in sorted(series.items()):
        third = wall / 3
        middle = max((v for t, v in points if third <= t < 2 * third), default=0)
        final = max((v for t, v in points if t >= 2 * third), default=0)
        peak = max(v for _, v in points)
        if middle and final:
            growth = max(growth, final / middle - 1)
        minutes: dict[int, int] = {}
        for t, v in points:
            minutes[int(t // 60)] = max(minutes.get(int(t // 60), 0), v)
        trend = " ".join(f"{v / 2**20:.0f}" for _, v in sorted(minutes.items()))
        print(
            f"  {name:<28} {peak / 2**20:7.1f}; {middle / 2**20:7.1f} -> {final / 2**20:7.1f}"
            f"  [{trend}]"
        )
    figures = {
        "duration_s": round(wall),
        "sent": sent,
        "succeeded": tally.outcome["succeeded"],
        "rejected": tally.outcome["rejected"],
        "disrupted": tally.outcome["disrupted"],
        "failed": tally.outcome["failed"],
        "p50_ms": round(pct(0.5)),
        "p95_ms": round(pct(0.95)),
        "p99_ms": round(pct(0.99)),
        "replicas_rss_peak_mib": round(total_peak / 2**20),
        "rss_growth_last_vs_middle_third_pct": round(100 * growth, 1),
    }
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="Endpoint to soak; default: start `selfrag serve` here.")
    p.add_argument("--home", help="SELFRAG_HOME of the server this script starts.")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--clients", type=int, default=4, help="Concurrent client threads.")
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-pid", type=int, help="With --url: count only replicas below it.")
    p.add_argument(
        "--events",
        help="Disruptions, kind@fraction-of-the-run, comma-separated (kinds: redis, replica, "
        "restart); default without --url: replica@0.1,restart@0.2,redis@0.5; '' for none",
    )
    p.add_argument("--redis-down-s", type=float, default=10.0, help="How long Redis stays down.")
    p.add_argument("--no-redis", action="store_true", help="No query-cache Redis of our own.")
    p.add_argument("--log", default="soak-serve.log", help="The started server's output.")
    args = p.parse_args(argv)
    if args.url:
        events = parse_events(args.events or "")
        if events:
            raise SystemExit("--events needs the server this script starts (no --url)")
        figures = soak(
            args.url, args.duration_s, args.clients, args.sample_s, args.seed, args.server_pid
        )
    else:
        default = "replica@0.1,restart@0.2,redis@0.5"
        events = parse_events(default if args.events is None else args.events)
        binary = None if args.no_redis else shutil.which("redis-server")
        if binary is None and any(kind == "redis" for kind, _ in events):
            raise SystemExit("a redis event needs redis-server on PATH (or drop it: --events)")
        redis = RedisServer(binary) if binary else None
        env = {}
        if redis is not None:
            redis.start()
            env = {"SELFRAG_REDIS_URL": redis.url, "SELFRAG_CACHE__REDIS_RETRY_S": "1"}
        server = Server(args.home, args.port, env, Path(args.log))
        try:
            print(f"server ready after {server.start():.0f} s", flush=True)
            figures = soak(
                server.url,
                args.duration_s,
                args.clients,
                args.sample_s,
                args.seed,
                server=server,
                redis=redis,
                events=events,
                redis_down_s=args.redis_down_s,
            )
        finally:
            if server.proc is not None and server.proc.poll() is None:
                server.stop()
            if redis is not None:
                redis.kill()
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 1 if figures["failed"] or figures.get("inflight_end") != 0 else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
