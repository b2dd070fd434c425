"""Which passage should a draft budget of one draft: the most relevant by s_rel, the retriever's
first, or the retriever's first unless the critique reads another far more relevant?

For the answerable questions of the tuning sets (SQuAD's "Normans" article and the tune half of
`bench/data/wiki_questions`), the top `--top-k` passages and their s_rel (`SelfRAG.retrieve`, no
drafting); each rule picks one, and the count is how often the pick holds a gold answer, beside
how often any of the top passages does. Run it with each model (`--model`) and source of s_rel
(`--critique`); the home must hold both corpora (the SQuAD sample and `wiki_sample_1000.jsonl`).
Last line: name=value.

    .venv/bin/python -m bench.draft_choice --home H --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS = (
    ("normans", ROOT.parent / "shared" / "data" / "squad_v2_small.json", "Normans"),
    ("wiki_tune", ROOT / "bench" / "data" / "wiki_questions.squad.json", "wiki_tune"),
)
MARGINS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)


def pick(s_rel: Sequence[float], margin: float) -> int:
    """The rule of `pipeline.branching.draft_order` for one draft: the retriever's first
    (index 0) unless another's s_rel is more than `margin` above its (then the most relevant)."""
    best = max(range(len(s_rel)), key=lambda i: (s_rel[i], -i))
    return best if s_rel[best] > s_rel[0] + margin else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True)
    parser.add_argument("--model", default=None, help="a preset; default: the configured one")
    parser.add_argument("--questions", type=int, default=40, help="answerable ones per set")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument(
        "--critique", default=None, help="the source of s_rel; default: the configured one"
    )
    args = parser.parse_args(argv)

    from selfrag import SelfRAG
    from selfrag.jobs.evaluation.eval_questions import load_questions
    from selfrag.pipeline.evaluation.qa_metrics import contains_answer
    from selfrag.pipeline.learning.logistic_fit import auc

    model = {"preset": args.model} if args.model else {}
    held: dict[str, list[tuple[list[float], list[bool]]]] = {}
    with SelfRAG.open(args.home, model=model) as rag:
        for name, path, article in SETS:
            questions = [q for q in load_questions(path, article=article) if q.answerable]
            rows = held.setdefault(name, [])
            for q in questions[: args.questions]:
                found = rag.retrieve(q.question, top_k=args.top_k, critique=args.critique)
                # `retrieve` ranks by s_rel: the retriever's order is by its score (stable).
                found.sort(key=lambda p: -p.score)
                rows.append(
                    ([p.s_rel for p in found], [contains_answer(p.text, q.golds) for p in found])
                )

    figures: dict[str, object] = {
        "model": args.model or "default",
        "critique": args.critique or "default",
    }
    print("| set | questions | answer in top k | " + " | ".join(f"m={m}" for m in MARGINS) + " |")
    print("| --- " * (3 + len(MARGINS)) + "|")
    for name in [*held, "all"]:
        rows = [r for n in held for r in held[n]] if name == "all" else held[name]
        rows = [r for r in rows if r[0]]
        cells = [sum(has[pick(s_rel, m)] for s_rel, has in rows) for m in MARGINS]
        reachable = sum(any(has) for _, has in rows)
        print(f"| {name} | {len(rows)} | {reachable} | " + " | ".join(map(str, cells)) + " |")
        if name == "all":
            figures |= {"questions": len(rows), "reachable": reachable}
            figures |= {f"margin_{m}": c for m, c in zip(MARGINS, cells, strict=True)}
            s_rels = [s for s_rel, _ in rows for s in s_rel]
            hits = [h for _, has in rows for h in has]
            figures["s_rel_auroc"] = round(auc(s_rels, hits) or 0.0, 3)
    print("m=0: by s_rel alone; m=1: the retriever's order; the product default is 0.5")
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
