"""Pruning before drafting, side by side in one run: `min_relevance` and `relevance_margin` with
the learned IsRel, and skipping the branches the hard filters reject whatever they draft.

Every policy answers every question in this process on one warm engine, the policies taking
turns question by question (the order rotating) so that load and cache warmth fall on all of
them alike. The query cache is off. Reported per policy: accuracy (answerable), abstention
(unanswerable), overall, evidence branches pruned, branches drafted, prefill and decode tokens
per answer, p50/p95 latency; and each policy's time and accuracy against the first one. Tune on
Normans (the default); report on the held-out article with `--article
Computational_complexity_theory`. Last line: name=value.

    .venv/bin/python -m bench.pruning --home ~/.local/share/selfrag --questions 30
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from selfrag.pipeline import branching

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad_v2_small.json"

# name -> (decoding overrides, whether certainly-filtered branches are skipped before drafting).
# Every policy pins the pruning dials and the draft budget, so that a change of the defaults
# changes only "default". "before": the learned defaults before relevance_margin and the skip
# existed; "nobudget": the defaults before max_drafts was 1.
NO_BUDGET = {"max_drafts": 50}
POLICIES: dict[str, tuple[dict[str, Any], bool]] = {
    "none": ({"min_relevance": 0.0, "relevance_margin": 1.0, **NO_BUDGET}, False),
    "before": ({"min_relevance": 0.5, "relevance_margin": 1.0, **NO_BUDGET}, False),
    "default": ({}, True),
    "nobudget": (NO_BUDGET, True),
    "skip": ({"min_relevance": 0.0, "relevance_margin": 1.0, **NO_BUDGET}, True),
    "rel0.3": ({"min_relevance": 0.3, "relevance_margin": 1.0, **NO_BUDGET}, True),
    "rel0.5": ({"min_relevance": 0.5, "relevance_margin": 1.0, **NO_BUDGET}, True),
    "rel0.7": ({"min_relevance": 0.7, "relevance_margin": 1.0, **NO_BUDGET}, True),
    "m0.2": ({"min_relevance": 0.0, "relevance_margin": 0.2, **NO_BUDGET}, False),
    "rel0.5+m0.2": ({"min_relevance": 0.5, "relevance_margin": 0.2, **NO_BUDGET}, True),
    "rel0.5+m0.05": ({"min_relevance": 0.5, "relevance_margin": 0.05, **NO_BUDGET}, True),
    "drafts2": ({"max_drafts": 2}, True),
    "drafts1": ({"max_drafts": 1}, True),
    # The budget where it binds: no relevance filter, the most relevant of the K drafts alone.
    "open1": ({"min_relevance": 0.0, "relevance_margin": 1.0, "max_drafts": 1}, True),
}


@contextmanager
def skipping(enabled: bool):
    """The pool's certainly-filtered skip, on or (to measure what it saves) off."""
    original = branching.certainly_filtered
    if not enabled:
        branching.certainly_filtered = lambda c, cfg: False  # type: ignore[assignment]
    try:
        yield
    finally:
        branching.certainly_filtered = original


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--article", default="Normans")
    parser.add_argument("--questions", type=int, default=30)
    parser.add_argument(
        "--policies", default="none,skip,rel0.3,rel0.5,rel0.7,rel0.5+m0.2,rel0.5+m0.05"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--records", type=Path, help="Also write the per-answer records here.")
    args = parser.parse_args(argv)

    from selfrag import SelfRAG
    from selfrag.jobs.evaluation.eval_questions import load_questions
    from selfrag.jobs.evaluation.eval_report import outcome
    from selfrag.jobs.evaluation.eval_runner import make_record
    from selfrag.pipeline.evaluation.qa_metrics import percentile, summarize

    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {list(POLICIES)}")
    questions = load_questions(args.data, article=args.article)[: args.questions]
    records: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    drafted: dict[str, list[int]] = {n: [] for n in names}
    sink = args.records.open("w") if args.records else None
    with SelfRAG.open(args.home, cache={"query": False}, model={"n_threads": args.threads}) as rag:
        rag.answer(questions[0].question)  # load the model and heads before timing
        for i, q in enumerate(questions):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                dials, skip = POLICIES[name]
                with skipping(skip):
                    t = time.perf_counter()
                    r = rag.answer(q.question, **dials)
                    ms = (time.perf_counter() - t) * 1e3
                p_ret = next((s.p_ret for s in r.segments if s.p_ret is not None), None)
                record = make_record(f"selfrag-{name}", q, r, p_ret, 0, ms)
                records[name].append(record)
                u = r.usage
                drafted[name].append(u.branches_opened - u.branches_pruned - u.branches_filtered)
                if sink is not None:
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
            print(f"{i + 1}/{len(questions)}", file=sys.stderr, flush=True)
    if sink is not None:
        sink.close()

    head = (
        "| policy | accuracy | abstain (unanswerable) | overall | pruned | drafted / answer "
        "| prefill / answer | decode / answer | p50 s | p95 s |"
    )
    print(f"{len(questions)} {args.article} questions, learned critique, product defaults\n")
    print(head)
    print("|" + " --- |" * 10)
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        s = summarize([outcome(r) for r in records[name]])
        decode = [r["decode_tokens"] for r in records[name]]
        latencies = [r["latency_ms"] / 1e3 for r in records[name]]
        rows[name] = {
            **s,
            "drafted": sum(drafted[name]) / len(drafted[name]),
            "decode": sum(decode) / len(decode),
            "p50_s": percentile(latencies, 50),
            "p95_s": percentile(latencies, 95),
        }
        row = rows[name]
        cells = [
            fmt(row["accuracy"], ".3f"),
            fmt(row["abstain_rate"], ".3f"),
            fmt(row["overall"], ".3f"),
            fmt(row["pruned_rate"], ".1%"),
            f"{row['drafted']:.2f}",
            f"{row['prefill_tokens']:.0f}",
            f"{row['decode']:.0f}",
            f"{row['p50_s']:.2f}",
            f"{row['p95_s']:.2f}",
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    base = rows[names[0]]
    pairs = [f"questions={len(questions)}"]
    for name in names:
        key = name.replace(".", "_").replace("+", "_")
        pairs.append(f"{key}_accuracy={fmt(rows[name]['accuracy'], '.3f')}")
        pairs.append(f"{key}_overall={fmt(rows[name]['overall'], '.3f')}")
        pairs.append(f"{key}_p50_over_{names[0]}={rows[name]['p50_s'] / base['p50_s']:.3f}")
    print(" ".join(pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
