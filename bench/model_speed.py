"""Model presets side by side: the warm seconds per answer of the default answer path.

The default model is the preset with the best held-out overall whose warm p50 per answer on this
machine stays within 3x SmolLM2's. This measures that ratio: each preset answers the same
Normans questions (the tuning article; answerable ones, in file order) through the Python API
(`SelfRAG.answer`, what `selfrag ask` runs) with the default decoding settings and the query
cache off, one llama.cpp thread each (`--threads`) and the passive OpenMP wait policy. Both
presets are open in this one process, each on its own copy of the indexed home (embedded Qdrant
allows one client per folder; the derived model files are shared through a link), and after one
warm-up answer each (a question outside the timed ones) their answers are interleaved, the order
alternating per question (A, B, then B, A), so background load on a shared machine hits both
alike.

Each preset uses its own critique as the defaults resolve it: the learned heads where heads
exist for its file, else the likelihood fallback (printed per preset). `--critique likelihood`
gives every preset the same critique, to compare the models' cost alone.

Reported per preset: p50 and p95 seconds per answer (linear interpolation), mean prefill and
decode tokens, retrievals, branches opened and pruned, and abstentions; the last line holds
`name=value` pairs with `qwen_over_smollm2_p50` (the second preset's p50 over the first's).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.model_speed --home INDEXED_HOME \
        [--questions 12] [--presets smollm2 qwen2.5-coder-0.5b] [--critique likelihood]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfrag.pipeline.evaluation.qa_metrics import percentile

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    """One preset's answers: seconds and the usage figures of each."""

    preset: str
    seconds: list[float] = field(default_factory=list)
    usage: list[dict[str, Any]] = field(default_factory=list)
    abstained: int = 0
    critique: str = ""

    def p(self, q: float) -> float:
        value = percentile(self.seconds, q)
        assert value is not None, "no answers timed"
        return value

    def mean(self, key: str) -> float:
        return statistics.mean(u[key] for u in self.usage)


def normans_questions(data: Path, n: int) -> list[str]:
    """The first `n` answerable questions of the Normans article, in file order."""
    squad = json.loads((data / "squad_v2_small.json").read_text(encoding="utf-8"))
    [article] = [a for a in squad["data"] if a["title"] == "Normans"]
    qs = [q["question"] for p in article["paragraphs"] for q in p["qas"] if not q["is_impossible"]]
    return qs[:n]


def home_copy(base: Path, target: Path) -> Path:
    """A copy of an indexed home for one preset; derived model weights shared (a link)."""
    shutil.copytree(base, target, ignore=shutil.ignore_patterns("models", "kv"))
    (base / "models").mkdir(exist_ok=True)
    (target / "models").symlink_to(base / "models", target_is_directory=True)
    return target


def timed_answer(rag: Any, question: str, dials: dict[str, Any], run: Run | None) -> float:
    """Answer once; record the time and usage in `run` (None: a warm-up, not recorded)."""
    started = time.perf_counter()
    r = rag.answer(question, **dials)
    seconds = time.perf_counter() - started
    if run is not None:
        run.seconds.append(seconds)
        run.usage.append(r.usage.model_dump())
        run.abstained += r.abstained
        run.critique = r.critique
    return seconds


def main(argv: list[str] | None = None) -> None:
    from selfrag import SelfRAG

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, required=True, help="an indexed SELFRAG_HOME")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--presets", nargs=2, default=["smollm2", "qwen2.5-coder-0.5b"])
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads per model")
    parser.add_argument("--critique", help="one critique source for every preset (a dial)")
    args = parser.parse_args(argv)

    dials: dict[str, Any] = {} if args.critique is None else {"critique": args.critique}
    *timed_qs, warm_q = normans_questions(args.data, args.questions + 1)
    if len(timed_qs) < args.questions:
        parser.error(f"only {len(timed_qs) + 1} answerable Normans questions")
    runs = [Run(name) for name in args.presets]
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="model-speed-") as tmp:
        rags = []
        try:
            for run in runs:
                home = home_copy(args.home.expanduser(), Path(tmp) / run.preset)
                rag = SelfRAG.open(
                    home,
                    cache={"query": False},
                    model={
                        "preset": run.preset,
                        "n_threads": args.threads,
                        "omp_wait_policy": "passive",
                    },
                )
                rags.append(rag)
                warm_s = timed_answer(rag, warm_q, dials, None)
                print(f"{run.preset}: warm-up answer {warm_s:.2f} s", flush=True)
            for i, q in enumerate(timed_qs):
                order = [0, 1] if i % 2 == 0 else [1, 0]
                for k in order:
                    timed_answer(rags[k], q, dials, runs[k])
                print(
                    f"q{i + 1}: " + ", ".join(f"{r.preset} {r.seconds[-1]:.2f} s" for r in runs),
                    flush=True,
                )
        finally:
            for rag in rags:
                rag.close()
    report(runs, load_start, os.getloadavg()[0])


def report(runs: list[Run], load_start: float, load_end: float) -> None:
    keys = ("prefill_tokens", "decode_tokens", "retrievals", "branches_opened", "branches_pruned")
    print(
        "\n| preset | critique | p50 s | p95 s | mean s | prefill | decode | retrievals "
        "| branches | pruned | abstained |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        means = " | ".join(f"{r.mean(k):.1f}" for k in keys)
        print(
            f"| {r.preset} | {r.critique} | {r.p(50):.2f} | {r.p(95):.2f} "
            f"| {statistics.mean(r.seconds):.2f} | {means} | {r.abstained}/{len(r.seconds)} |"
        )
    a, b = runs
    stem = {"smollm2": "smollm2", "qwen2.5-coder-0.5b": "qwen"}
    na, nb = stem.get(a.preset, "a"), stem.get(b.preset, "b")
    figures = {
        "questions": len(a.seconds),
        f"{na}_p50_s": a.p(50),
        f"{na}_p95_s": a.p(95),
        f"{nb}_p50_s": b.p(50),
        f"{nb}_p95_s": b.p(95),
        f"{nb}_over_{na}_p50": b.p(50) / a.p(50),
        f"{nb}_over_{na}_p95": b.p(95) / a.p(95),
        "load1_start": load_start,
        "load1_end": load_end,
    }
    print()
    print(
        " ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.2f}" for k, v in figures.items())
    )


if __name__ == "__main__":
    main()
