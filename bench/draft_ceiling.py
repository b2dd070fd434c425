"""How many answers one draft per passage could get right, and which read picks them.

For the answerable questions of a set (`--data`, `--article`, `--limit` as `selfrag eval`
takes them), the served model drafts one segment on each of the retriever's top `--top-k`
passages, as the decoder's first step drafts a branch, and the served critique reads each
draft's s_rel, s_sup and support score (s_sup times the passage's similarity: what the support
threshold reads). Each rule then picks one draft per question; the count is how many picked
drafts hold a gold answer, beside how many questions any draft answers right (the ceiling of
any choice among these drafts) and how many have a gold answer in some passage. Rules: the
retriever's first; the product's draft order for a budget of one (`draft_order_margin`); the
highest s_sup, support score, s_rel, and `w_rel`·s_rel + `w_sup`·s_sup (the ranking's critique
terms). Last line: name=value.

    .venv/bin/python -m bench.draft_ceiling --home H --article Normans --limit 100
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.draft_choice import pick

ROOT = Path(__file__).resolve().parents[1]
SQUAD = ROOT.parent / "shared" / "data" / "squad_v2_small.json"


@dataclass(frozen=True)
class Draft:
    """One question's draft on one passage, with its reads."""

    right: bool
    passage_has_answer: bool
    s_rel: float
    s_sup: float | None
    support: float | None


Rule = Callable[[Sequence[Draft]], int]


def highest(key: Callable[[Draft], float | None]) -> Rule:
    """The draft whose `key` is highest (a draft without a read never wins; ties: the first)."""

    def rule(drafts: Sequence[Draft]) -> int:
        scored = [(k, -i) for i, d in enumerate(drafts) if (k := key(d)) is not None]
        return -max(scored)[1] if scored else 0

    return rule


def rules(margin: float, w_rel: float, w_sup: float) -> dict[str, Rule]:
    """The rules compared, by name, with the served config's margin and weights."""
    return {
        "retriever_first": lambda drafts: 0,
        "draft_order": lambda drafts: pick([d.s_rel for d in drafts], margin),
        "max_s_sup": highest(lambda d: d.s_sup),
        "max_support": highest(lambda d: d.support),
        "max_s_rel": highest(lambda d: d.s_rel),
        "max_ranking": highest(
            lambda d: None if d.s_sup is None else w_rel * d.s_rel + w_sup * d.s_sup
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True)
    parser.add_argument("--data", type=Path, default=SQUAD)
    parser.add_argument("--article", default=None)
    parser.add_argument("--limit", type=int, default=None, help="the first N questions")
    parser.add_argument("--model", default=None, help="a preset; default: the configured one")
    parser.add_argument("--top-k", type=int, default=3)
    args = parser.parse_args(argv)

    from selfrag import SelfRAG
    from selfrag.jobs.evaluation.eval_questions import load_questions
    from selfrag.pipeline.branching import read_evidence_branches
    from selfrag.pipeline.critics import Branch
    from selfrag.pipeline.critics.filters import settle_filters
    from selfrag.pipeline.evaluation.qa_metrics import contains_answer
    from selfrag.pipeline.scoring import evidence_support

    questions = [
        q for q in load_questions(args.data, article=args.article, limit=args.limit) if q.answerable
    ]
    model = {"preset": args.model} if args.model else {}
    per_question: list[list[Draft]] = []
    with SelfRAG.open(args.home, model=model) as rag:
        rt = rag.system
        critic = rt.critic(rt.settings.decoding.critique)
        cfg = settle_filters(rt.settings.decoding, critic.name)
        for q in questions:
            passages = rt.store.search(q.question, args.top_k)
            branches = [Branch(q.question, "", p) for p in passages]
            if not branches:
                per_question.append([])
                continue
            reads = read_evidence_branches(critic, branches, cfg.max_segment_tokens)
            sims = rt.store.similarities([(q.question, p) for p in passages])
            drafts = []
            for p, read, sim in zip(passages, reads, sims, strict=True):
                s_sup = read.s_sup
                drafts.append(
                    Draft(
                        right=contains_answer(read.draft.text, q.golds),
                        passage_has_answer=contains_answer(p.text, q.golds),
                        s_rel=read.s_rel,
                        s_sup=s_sup,
                        support=None if s_sup is None else evidence_support(s_sup, sim),
                    )
                )
            per_question.append(drafts)

    chosen = rules(cfg.draft_order_margin, cfg.w_rel, cfg.w_sup)
    answered = [drafts for drafts in per_question if drafts]
    figures: dict[str, object] = {
        "questions": len(per_question),
        "answer_in_passages": sum(any(d.passage_has_answer for d in ds) for ds in answered),
        "any_draft_right": sum(any(d.right for d in ds) for ds in answered),
    }
    figures |= {name: sum(ds[rule(ds)].right for ds in answered) for name, rule in chosen.items()}
    print(f"{args.data.name} {args.article or ''}: top {args.top_k}, drafts right per rule")
    for name, value in figures.items():
        print(f"  {name:<20} {value}")
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
