"""Replica affinity with two branch-pool replicas: the same answers with `serve.affinity` on
(every call of an answer carries one session id; the pool routes by consistent hashing) and
off (each call goes to either replica).

A later step of an answer extends the prompts of its earlier steps, and the replica that ran
them holds those KV cells (and, without Redis, the passages' KV states): a step that lands on
the other replica decodes them again. So the prefill tokens per step, as the engines report
them, show the cache hits that affinity keeps. Each setting starts its own `selfrag serve`
(`serve.pool_replicas=2`), answers the same distinct questions one at a time, and reports the
prefill tokens per step and per answer and the latency. The last line holds the figures as
name=value.

    .venv/bin/python -m bench.affinity --home $SELFRAG_HOME --questions 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import httpx

from bench.serve_load import WARMUP_QUESTION, questions, served

CONFIG = {"mode": "always", "top_k": 2, "max_segments": 3, "max_segment_tokens": 16}


def answer_all(url: str, qs: Sequence[str]) -> dict[str, float]:
    httpx.post(
        url + "/v1/answer", json={"question": WARMUP_QUESTION, "config": CONFIG}, timeout=300
    )
    prefill, steps, seconds = [], [], []
    for q in qs:
        started = time.perf_counter()
        r = httpx.post(url + "/v1/answer", json={"question": q, "config": CONFIG}, timeout=300)
        r.raise_for_status()
        seconds.append(time.perf_counter() - started)
        usage = r.json()["usage"]
        prefill.append(usage["prefill_tokens"])
        steps.append(usage["steps"])
    return {
        "prefill_per_step": sum(prefill) / sum(steps),
        "prefill_per_answer": statistics.mean(prefill),
        "steps_per_answer": statistics.mean(steps),
        "p50_s": statistics.median(seconds),
        "mean_s": statistics.mean(seconds),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--home", help="SELFRAG_HOME of the servers this script starts.")
    p.add_argument("--port", type=int, default=8767)
    p.add_argument("--questions", type=int, default=10)
    p.add_argument(
        "--order",
        default="on,off",
        help="Which setting runs first (off,on to check that the order does not decide it).",
    )
    args = p.parse_args(argv)
    order = [s.strip() for s in args.order.split(",")]
    if sorted(order) != ["off", "on"]:
        p.error("--order must name on and off once each")
    qs = questions()[: args.questions]
    results: dict[str, dict[str, float]] = {}
    os.environ["SELFRAG_SERVE__POOL_REPLICAS"] = "2"
    for setting in order:
        os.environ["SELFRAG_SERVE__AFFINITY"] = "true" if setting == "on" else "false"
        print(f"affinity {setting}: starting selfrag serve with 2 pool replicas", flush=True)
        with served(args.home, args.port, None) as (url, _):
            results[setting] = answer_all(url, qs)
    print(
        f"\n{'affinity':<8} {'prefill/step':>12} {'prefill/answer':>14} {'steps':>6} {'p50 s':>6}"
    )
    figures: dict[str, str] = {"questions": str(len(qs))}
    for setting, r in results.items():
        print(
            f"{setting:<8} {r['prefill_per_step']:>12.0f} {r['prefill_per_answer']:>14.0f} "
            f"{r['steps_per_answer']:>6.2f} {r['p50_s']:>6.2f}"
        )
        for k, v in r.items():
            figures[f"{k}_{setting}"] = f"{v:.2f}"
    on, off = results["on"]["prefill_per_step"], results["off"]["prefill_per_step"]
    figures["prefill_saved_by_affinity"] = f"{1 - on / off:.3f}" if off else "n/a"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
