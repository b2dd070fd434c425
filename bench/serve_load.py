"""Load on the HTTP endpoint from a second process on loopback.

Without `--url` it starts `selfrag serve` itself (a child process, stopped with SIGTERM), once
with cross-request batching and once with it off (`SELFRAG_SERVE__MAX_BATCH_SIZE=1`), and
prints side by side: throughput and p50/p95 latency at each client count, the time per branch
step of questions whose passages the server has not seen (cold passage-KV cache) against
questions whose passages it has (warm), then the latency of one question asked again and again.
With `--url` it measures that endpoint only (no batching-off column). Bounded by
`--requests-per-client` and `--level-seconds` per level.
After the load levels it reads the server's `/metrics`: remote calls and pickled bytes per
decoding step between the ingress and the other deployments (`selfrag_remote_*`, when the
server counts them), and the memory of the app's replica processes (VmRSS and PSS; with
`--url`, of the processes under `--server-pid`).
The last line holds the figures as `name=value`.

    .venv/bin/python -m bench.serve_load --home /path/to/indexed/home
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.processes import replica_rss

SQUAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad_v2_small.json"
FALLBACK_QUESTIONS = [
    "Who was the Norse leader who founded Normandy?",
    "In what country is Normandy located?",
    "When were the Normans in Normandy?",
    "What religion were the Normans?",
]
SMALL_CONFIG = {"mode": "always", "top_k": 2, "max_segments": 1, "max_segment_tokens": 16}


WARMUP_QUESTION = "What is the capital of France?"


def paragraph_question_pairs(n: int) -> list[tuple[str, str]]:
    """Two answerable questions from each of the last `n` Normans paragraphs: different
    questions that retrieve the same passages."""
    if not SQUAD.exists():
        return [(FALLBACK_QUESTIONS[0], FALLBACK_QUESTIONS[2])]
    data = json.loads(SQUAD.read_text())
    paras = next(a for a in data["data"] if a["title"] == "Normans")["paragraphs"]
    pairs = []
    for para in reversed(paras):
        qs = [qa["question"] for qa in para["qas"] if not qa.get("is_impossible")]
        if len(qs) >= 2:
            pairs.append((qs[0], qs[1]))
    return pairs[:n]


def questions(n: int = 400) -> list[str]:
    """Distinct questions of the Normans article (so no two requests are the same)."""
    if not SQUAD.exists():
        return FALLBACK_QUESTIONS
    data = json.loads(SQUAD.read_text())
    out = [
        qa["question"]
        for article in data["data"]
        if article["title"] == "Normans"
        for para in article["paragraphs"]
        for qa in para["qas"]
    ]
    return out[:n] or FALLBACK_QUESTIONS


@dataclass
class Level:
    clients: int
    done: int
    errors: int
    seconds: float
    latencies: list[float]

    @property
    def throughput(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def drive(
    url: str, qs: Sequence[str], clients: int, per_client: int, limit_s: float, config: dict
) -> Level:
    """`clients` threads, each posting up to `per_client` questions, stopping at `limit_s`."""
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    counter = iter(range(10**9))
    deadline = time.perf_counter() + limit_s

    def worker() -> None:
        nonlocal errors
        with httpx.Client(base_url=url, timeout=max(limit_s, 30.0)) as client:
            for _ in range(per_client):
                if time.perf_counter() >= deadline:
                    return
                with lock:
                    q = qs[next(counter) % len(qs)]
                t = time.perf_counter()
                r = client.post("/v1/answer", json={"question": q, "config": config})
                with lock:
                    if r.status_code == 200:
                        latencies.append(time.perf_counter() - t)
                    else:
                        errors += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker) for _ in range(clients)]:
            f.result()
    return Level(clients, len(latencies), errors, time.perf_counter() - start, latencies)


def repeated(url: str, question: str, times: int, config: dict) -> tuple[list[float], list[str]]:
    """Latency of one question asked `times` times in a row, and each X-Cache header."""
    out: list[float] = []
    cache: list[str] = []
    with httpx.Client(base_url=url, timeout=300) as client:
        for _ in range(times):
            t = time.perf_counter()
            r = client.post("/v1/answer", json={"question": question, "config": config})
            r.raise_for_status()
            out.append(time.perf_counter() - t)
            cache.append(r.headers.get("x-cache", "?"))
    return out, cache


@dataclass
class StepTime:
    """One answer's time per evidence branch of its step and its passages' cache state."""

    question: str
    state: str  # "cold": no passage seen before by this server; "warm": all seen; "mixed"
    ms_per_branch: float
    prefill_tokens: int


def passage_kv(url: str, pairs: Sequence[tuple[str, str]], config: dict) -> list[StepTime]:
    """Ask both questions of each pair in turn; classify each answer by whether this server
    had already seen its passages, and time its branch step (relevance + draft + critique) per
    evidence branch, from the response's own `timings_ms`."""
    seen: set[str] = set()
    out: list[StepTime] = []
    with httpx.Client(base_url=url, timeout=300) as client:
        warmup = client.post("/v1/answer", json={"question": WARMUP_QUESTION, "config": config})
        seen |= {p["id"] for p in warmup.json().get("passages", [])}
        for question in (q for pair in pairs for q in pair):
            r = client.post("/v1/answer", json={"question": question, "config": config})
            r.raise_for_status()
            body = r.json()
            ids = {p["id"] for p in body["passages"]}
            branches = body["usage"]["branches_opened"]
            if not ids or not branches:
                continue
            state = "warm" if ids <= seen else "cold" if not ids & seen else "mixed"
            seen |= ids
            t = body["timings_ms"]
            step_ms = t.get("relevance", 0.0) + t.get("draft", 0.0) + t.get("critique", 0.0)
            out.append(
                StepTime(question, state, step_ms / branches, body["usage"]["prefill_tokens"])
            )
    return out


def wait_ready(
    url: str, proc: subprocess.Popen[bytes] | None, limit_s: float, path: str = "/readyz"
) -> None:
    """Until `url + path` answers 200; raises if `proc` exits first or `limit_s` passes."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready within {limit_s:.0f} s")


def route_figures(url: str) -> dict[str, float]:
    """Remote calls and bytes per decoding step, from the server's own counters."""
    text = httpx.get(url + "/metrics", timeout=10).text
    totals = {"calls": 0.0, "sent": 0.0, "received": 0.0, "steps": 0.0}
    for line in text.splitlines():
        if line.startswith("selfrag_remote_calls_total{"):
            totals["calls"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("selfrag_remote_bytes_total{"):
            direction = "sent" if 'direction="sent"' in line else "received"
            totals[direction] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("selfrag_decoding_steps_total "):
            totals["steps"] = float(line.rsplit(" ", 1)[1])
    if not totals["steps"] or not totals["calls"]:
        return {}
    n = totals["steps"]
    return {
        "calls_per_step": totals["calls"] / n,
        "kb_sent_per_step": totals["sent"] / n / 1024,
        "kb_received_per_step": totals["received"] / n / 1024,
    }


def app_memory_mib(server_pid: int | None) -> dict[str, dict[str, float]]:
    """VmRSS and PSS (MiB) of the Serve replica processes, per deployment. PSS splits pages
    that processes share (the model file mapped by every engine replica) between them."""
    out: dict[str, dict[str, float]] = {}
    for name, rss in replica_rss(server_pid).items():
        deployment, pid = name.rstrip("]").split("[", 1)
        pss = 0
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
        except OSError:  # the process ended meanwhile
            continue
        row = out.setdefault(deployment, {"rss": 0.0, "pss": 0.0})
        row["rss"] += rss / 2**20
        row["pss"] += pss / 2**20
    return out


@contextmanager
def served(home: str | None, port: int, batch_size: int | None) -> Iterator[tuple[str, int]]:
    """`selfrag serve` in a child process (its URL and pid); SIGTERM on exit."""
    env = dict(os.environ)
    if home:
        env["SELFRAG_HOME"] = home
    if batch_size is not None:
        env["SELFRAG_SERVE__MAX_BATCH_SIZE"] = str(batch_size)
    cmd = [sys.executable, "-m", "selfrag.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 300)
        yield url, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_levels(url: str, args: argparse.Namespace, qs: Sequence[str]) -> dict[int, Level]:
    """One load level per client count, each with questions no earlier request asked: the
    query cache is on, and a hit would measure the cache instead of the engine."""
    out = {}
    # Warm the engine and the embedder so the first level does not pay for loading.
    drive(url, [WARMUP_QUESTION], 1, 1, args.level_seconds, SMALL_CONFIG)
    offset = 0
    for c in args.clients:
        n = c * args.requests_per_client
        level = qs[offset : offset + n]
        if len(level) < n:
            raise SystemExit(f"only {len(qs)} distinct questions: fewer clients or requests")
        offset += n
        out[c] = drive(url, level, c, args.requests_per_client, args.level_seconds, SMALL_CONFIG)
        print(f"  {c} clients: {out[c].done} answers in {out[c].seconds:.1f} s", flush=True)
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="Measure this running endpoint instead of starting one.")
    p.add_argument("--home", help="SELFRAG_HOME of the server this script starts.")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--level-seconds", type=float, default=120.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--kv-pairs", type=int, default=8, help="Paragraphs for the passage-KV comparison."
    )
    p.add_argument("--server-pid", type=int, help="With --url: the server, for its RSS.")
    p.add_argument(
        "--skip-unbatched",
        action="store_true",
        help="Leave out the second server with cross-request batching off.",
    )
    return p.parse_args(argv)


@dataclass
class Measured:
    """Everything one run measured, on the batched server (and the unbatched one's levels)."""

    levels: dict[str, dict[int, Level]]
    steps: list[StepTime]
    route: dict[str, float]
    memory: dict[str, dict[str, float]]
    repeat: tuple[list[float], list[str]]


def measure_server(
    url: str, pid: int | None, args: argparse.Namespace, qs: Sequence[str]
) -> Measured:
    """The batched server's figures: passage KV states first, while it has seen no Normans
    passage yet, then the load levels, the route and memory, and the repeated query."""
    steps = passage_kv(url, paragraph_question_pairs(args.kv_pairs), SMALL_CONFIG)
    levels = {"batched": run_levels(url, args, qs)}
    route, memory = route_figures(url), app_memory_mib(pid)
    repeat = repeated(url, qs[0], args.repeats, SMALL_CONFIG)
    return Measured(levels, steps, route, memory, repeat)


def measure(args: argparse.Namespace) -> Measured:
    qs = questions()
    if args.url:
        print(f"measuring {args.url}", flush=True)
        return measure_server(args.url, args.server_pid, args, qs)
    print("batching on (serve.max_batch_size from settings)", flush=True)
    with served(args.home, args.port, None) as (url, pid):
        out = measure_server(url, pid, args, qs)
    if not args.skip_unbatched:
        print("batching off (serve.max_batch_size=1)", flush=True)
        with served(args.home, args.port, 1) as (url, _):
            out.levels["unbatched"] = run_levels(url, args, qs)
    return out


def report_levels(
    clients: Sequence[int], results: dict[str, dict[int, Level]], figures: dict[str, str]
) -> None:
    header = f"{'clients':>7}  {'mode':<9}  {'answers':>7}  {'err':>3}  {'answers/s':>9}"
    print(header + f"  {'p50 s':>6}  {'p95 s':>6}")
    for c in clients:
        for mode, levels in results.items():
            lv = levels[c]
            print(
                f"{c:>7}  {mode:<9}  {lv.done:>7}  {lv.errors:>3}  {lv.throughput:>9.3f}  "
                f"{lv.pct(0.5):>6.2f}  {lv.pct(0.95):>6.2f}"
            )
            tag = "" if mode == "batched" else "_nobatch"
            figures[f"rps_c{c}{tag}"] = f"{lv.throughput:.3f}"
            figures[f"p50_c{c}{tag}_s"] = f"{lv.pct(0.5):.2f}"
            figures[f"p95_c{c}{tag}_s"] = f"{lv.pct(0.95):.2f}"
    top = max(clients)
    if "unbatched" in results and results["unbatched"][top].throughput:
        gain = results["batched"][top].throughput / results["unbatched"][top].throughput
        print(f"\nbatching gain at {top} clients: {gain:.2f}x throughput")
        figures[f"batching_gain_c{top}"] = f"{gain:.2f}"


def report_passage_kv(steps: Sequence[StepTime], figures: dict[str, str]) -> None:
    print("\npassage KV cache (same passages, different questions), ms per branch step:")
    print(f"{'state':<6}  {'answers':>7}  {'median ms':>9}  {'prefill tok':>11}")
    medians: dict[str, float] = {}
    for state in ("cold", "warm", "mixed"):
        group = [s for s in steps if s.state == state]
        if not group:
            continue
        medians[state] = statistics.median(s.ms_per_branch for s in group)
        prefill = statistics.median(s.prefill_tokens for s in group)
        print(f"{state:<6}  {len(group):>7}  {medians[state]:>9.0f}  {prefill:>11.0f}")
    for state in ("cold", "warm"):
        if state in medians:
            figures[f"kv_{state}_ms_per_branch"] = f"{medians[state]:.0f}"
    if "cold" in medians and "warm" in medians and medians["warm"]:
        speedup = medians["cold"] / medians["warm"]
        print(f"warm passage-KV: {speedup:.2f}x faster per branch step")
        figures["kv_warm_speedup"] = f"{speedup:.2f}"


def report_app(
    route: dict[str, float], memory: dict[str, dict[str, float]], figures: dict[str, str]
) -> None:
    if route:
        print(
            f"\nroute: {route['calls_per_step']:.2f} remote calls per step, "
            f"{route['kb_sent_per_step']:.1f} KiB sent and "
            f"{route['kb_received_per_step']:.1f} KiB received per step"
        )
        figures.update({k: f"{v:.2f}" for k, v in route.items()})
    if memory:
        print("\napp memory, MiB (RSS / PSS):")
        for deployment, row in sorted(memory.items()):
            print(f"  {deployment:<18} {row['rss']:>6.0f} / {row['pss']:>6.0f}")
        figures["app_rss_mib"] = f"{sum(r['rss'] for r in memory.values()):.0f}"
        figures["app_pss_mib"] = f"{sum(r['pss'] for r in memory.values()):.0f}"


def report_repeat(repeat: tuple[list[float], list[str]], figures: dict[str, str]) -> None:
    times, cache = repeat
    ms = [t * 1e3 for t in times]
    later = sorted(ms[1:] or ms)
    p95 = later[min(len(later) - 1, int(0.95 * len(later)))]
    print(
        f"\nrepeated query x{len(ms)}: first {ms[0]:.0f} ms, then p50 "
        f"{statistics.median(later):.1f} ms, p95 {p95:.1f} ms, max {later[-1]:.1f} ms; "
        f"X-Cache: {' '.join(cache)}"
    )
    figures["repeat_first_ms"] = f"{ms[0]:.0f}"
    figures["repeat_p50_ms"] = f"{statistics.median(later):.1f}"
    figures["repeat_p95_ms"] = f"{p95:.1f}"
    figures["repeat_hits"] = str(cache.count("hit"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    measured = measure(args)
    print()
    figures: dict[str, str] = {}
    report_levels(args.clients, measured.levels, figures)
    report_passage_kv(measured.steps, figures)
    report_app(measured.route, measured.memory, figures)
    report_repeat(measured.repeat, figures)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
