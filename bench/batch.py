"""Questions per second: one question at a time (the CLI path, `LocalRuntime.answer` in a loop) vs
`selfrag batch` (`selfrag.jobs.batch.batch_driver.run_batch`) with 1 and 2 engine actors, in one
run.

Every request is `{"mode": "always", "top_k": 2, "max_segments": 1, "max_segment_tokens": 16}`
on distinct SQuAD questions, so no answer comes from a cache. One-at-a-time excludes the model
load (one warm-up question first); batch figures are end to end (Ray start, actor and model
load included) and also "steady" (from the first record to the last).

    .venv/bin/python -m bench.batch --home $SELFRAG_HOME --questions 64

With `--address HEAD:PORT` it compares a running Ray cluster with a private single-node Ray
instead: the same questions and the same pool (the last `--actors` count) on the cluster first, then
on a private instance on this machine; the one-at-a-time pass is left out. On one machine whose
"nodes" are two raylets sharing its cores, the difference is Ray's scheduling and transfer
overhead across nodes, not a speed-up.

    .venv/bin/python -m bench.batch --home $SELFRAG_HOME --questions 8 --actors 2 \
        --address 127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from selfrag.infra.settings_loader import load_settings
from selfrag.jobs.batch.batch_driver import run_batch
from selfrag.jobs.ray_pool import ensure_ray
from selfrag.runtime.answer_client import LocalAnswerClient
from selfrag.runtime.system import LocalRuntime
from selfrag.schemas.answer import AnswerRequest

SMALL = {"mode": "always", "top_k": 2, "max_segments": 1, "max_segment_tokens": 16}
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad_v2_small.json"


def squad_questions(n: int) -> list[str]:
    """The first `n + 1` distinct questions (one is the warm-up)."""
    data = json.loads(DATA.read_text())
    qs = [qa["question"] for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]]
    return list(dict.fromkeys(qs))[: n + 1]


def one_at_a_time(home: Path, questions: list[str]) -> float:
    settings = load_settings(overrides={"home": str(home)})
    with LocalRuntime(settings) as rag:
        client = LocalAnswerClient.for_runtime(rag)
        client.answer(AnswerRequest.model_validate({"question": questions[0], "config": SMALL}))
        started = time.perf_counter()
        for q in questions[1:]:
            client.answer(AnswerRequest.model_validate({"question": q, "config": SMALL}))
        return time.perf_counter() - started


def batch(home: Path, questions: list[str], actors: int, per_actor: int) -> dict[str, float]:
    settings = load_settings(overrides={"home": str(home)})
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "q.jsonl"
        src.write_text(
            "".join(
                json.dumps({"id": str(i), "question": q, "config": SMALL}) + "\n"
                for i, q in enumerate(questions[1:])
            )
        )
        stamps: list[float] = []
        started = time.perf_counter()
        summary = run_batch(
            settings,
            src,
            Path(tmp) / "a.jsonl",
            actors=actors,
            per_actor=per_actor,
            progress=False,
            on_record=lambda r: stamps.append(time.perf_counter()),
        )
        total = time.perf_counter() - started
    if summary.answered != len(questions) - 1:
        raise SystemExit(f"batch with {actors} actor(s): {summary.line()}")
    first = sum(1 for s in stamps if s - stamps[0] < 0.5)  # the first batch's records
    steady = (len(stamps) - first) / (stamps[-1] - stamps[0]) if stamps[-1] > stamps[0] else 0.0
    return {
        "qps": len(stamps) / total,
        "steady_qps": steady,
        "seconds": total,
        "first_record_s": stamps[0] - started,
    }


def cluster_vs_local(
    home: Path, questions: list[str], actors: int, per_actor: int, address: str
) -> None:
    """The same batch on the cluster at `address`, then on a private single-node Ray."""
    import ray

    n = len(questions) - 1
    # The cluster first: the private instance's start sets environment variables for itself.
    ensure_ray(address)
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    on_cluster = batch(home, questions, actors, per_actor)
    ray.shutdown()
    ensure_ray(None)
    local = batch(home, questions, actors, per_actor)
    ray.shutdown()
    figures: dict[str, Any] = {"questions": n, "actors": actors, "nodes": nodes}
    for name, r in (("cluster", on_cluster), ("local", local)):
        for key, value in r.items():
            figures[f"{key}_{name}"] = value
        figures[f"steady_qps_per_actor_{name}"] = r["steady_qps"] / actors
    figures["overhead_s"] = on_cluster["seconds"] - local["seconds"]
    figures["startup_overhead_s"] = on_cluster["first_record_s"] - local["first_record_s"]
    figures["steady_ratio"] = (
        on_cluster["steady_qps"] / local["steady_qps"] if local["steady_qps"] else 0.0
    )
    print("| run | questions/s (end to end) | questions/s (steady) | first record s | seconds |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in ((f"cluster, {nodes} nodes", on_cluster), ("private single node", local)):
        print(
            f"| {name}, {actors} actor(s) | {r['qps']:.3f} | {r['steady_qps']:.3f} "
            f"| {r['first_record_s']:.1f} | {r['seconds']:.1f} |"
        )
    print(_pairs(figures))


def _pairs(figures: dict[str, Any]) -> str:
    return " ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, required=True, help="An indexed SELFRAG_HOME.")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--actors", default="1,2", help="Actor counts to run, comma-separated.")
    parser.add_argument("--per-actor", type=int, default=8)
    parser.add_argument(
        "--address", help="A running Ray cluster: compare it with a private single-node Ray."
    )
    args = parser.parse_args()
    questions = squad_questions(args.questions)
    if args.address:
        cluster_vs_local(
            args.home, questions, int(args.actors.split(",")[-1]), args.per_actor, args.address
        )
        return
    n = len(questions) - 1
    seconds = one_at_a_time(args.home, questions)
    figures: dict[str, Any] = {"questions": n, "qps_single": n / seconds}
    rows = [("one at a time (LocalRuntime.answer loop)", n / seconds, None, seconds)]
    ensure_ray(None)  # one Ray instance for every batch run
    for actors in (int(a) for a in args.actors.split(",")):
        r = batch(args.home, questions, actors, args.per_actor)
        rows.append((f"selfrag batch, {actors} actor(s)", r["qps"], r["steady_qps"], r["seconds"]))
        figures[f"qps_batch_a{actors}"] = r["qps"]
        figures[f"steady_qps_batch_a{actors}"] = r["steady_qps"]
        figures[f"speedup_a{actors}"] = r["qps"] / figures["qps_single"]
    print("| path | questions/s (end to end) | questions/s (steady) | seconds |")
    print("| --- | ---: | ---: | ---: |")
    for name, qps, steady, secs in rows:
        print(f"| {name} | {qps:.3f} | {'-' if steady is None else f'{steady:.3f}'} | {secs:.1f} |")
    print(_pairs(figures))


if __name__ == "__main__":
    main()
