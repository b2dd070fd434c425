"""Questions per second: one question at a time (the CLI path, `SelfRAGSystem.answer` in a loop) vs
`selfrag batch` (`selfrag.jobs.batch.run_batch`) with 1 and 2 engine actors, in one run.

Every request is `{"mode": "always", "top_k": 2, "max_segments": 1, "max_segment_tokens": 16}`
on distinct SQuAD questions, so no answer comes from a cache. One-at-a-time excludes the model
load (one warm-up question first); batch figures are end to end (Ray start, actor and model
load included) and also "steady" (from the first record to the last).

    .venv/bin/python -m bench.batch --home $SELFRAG_HOME --questions 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from selfrag.infra.settings import load_settings
from selfrag.jobs.batch import ensure_ray, run_batch
from selfrag.runtime.system import SelfRAGSystem
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
    with SelfRAGSystem(settings) as rag:
        rag.answer(AnswerRequest.model_validate({"question": questions[0], "config": SMALL}))
        started = time.perf_counter()
        for q in questions[1:]:
            rag.answer(AnswerRequest.model_validate({"question": q, "config": SMALL}))
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
    return {"qps": len(stamps) / total, "steady_qps": steady, "seconds": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, required=True, help="An indexed SELFRAG_HOME.")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--actors", default="1,2", help="Actor counts to run, comma-separated.")
    parser.add_argument("--per-actor", type=int, default=8)
    args = parser.parse_args()
    questions = squad_questions(args.questions)
    n = len(questions) - 1
    seconds = one_at_a_time(args.home, questions)
    figures: dict[str, Any] = {"questions": n, "qps_single": n / seconds}
    rows = [("one at a time (SelfRAGSystem.answer loop)", n / seconds, None, seconds)]
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
    print(
        " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    )


if __name__ == "__main__":
    main()
