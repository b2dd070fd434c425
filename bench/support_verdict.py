"""Support-verdict benchmark: which read tells a supported draft from an unsupported one.

For `--questions` answerable and as many unanswerable questions of one SQuAD v2 article
(`--article`; Normans is the tuning article, Computational_complexity_theory the held-out one),
the served model drafts one segment per branch, as the decoder's first step does, and every
candidate support read scores the same (passage, question, draft) triples:

* supported: the gold paragraph, and a draft that contains a gold answer;
* wrong: the gold paragraph, and a draft that contains no gold answer;
* trap: an unanswerable question on its own paragraph (SQuAD 2.0's adversarial case);
* absent: an answerable question on a paragraph of another article (the answer is in no
  passage shown);
* swapped: the gold paragraph with another question's gold answer as the "draft" (a claim the
  passage does not make for this question, written as the model would copy it).

Candidates: `source` (the critique source's own s_sup: heads, answerability model), `verify`
(the generator's yes/no, `pipeline.critics.verify`, in a conversation of its own after the
passage), `verify_followup` (the same question as a user turn after the draft, on the drafting
sequence), `terms` (the share of the draft's numbers and names found in the passage and its
title), `sentence` (the share of its words one sentence of the passage holds), `grounding`
(their product, what the critique uses; each `pipeline.grounding`, 1 when there is nothing to
check), `relevance` (s_rel of the branch), `retrieval` (the retriever's dense score: the
embedder's cosine of question and passage), `verify*terms`, `verify*grounding`,
`verify*grounding*retrieval`, and with `--critic-model` that
preset's verification read of the same drafts (`critic_model`, in a conversation of its own).
With `--heads H…` only the s_sup of each heads file (`heads:<file stem>`, the learned critique on
the same model, nothing folded in) is scored instead, e.g. heads trained with and without a critic's
labels (`selfrag train --critic`).
Printed: AUROC of supported against each unsupported kind and against all of them, and seconds
per read. The last line
holds the figures as name=value pairs.

    .venv/bin/python -m bench.support_verdict [--model qwen2.5-coder-0.5b] [--article Normans]
                                              [--questions 30] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from selfrag.infra.settings_loader import load_settings
from selfrag.infra.store.qdrant_engine import cosine
from selfrag.pipeline.critics import Branch, Critic
from selfrag.pipeline.critics.chat import ChatCritic
from selfrag.pipeline.critics.verify import VerifyReader
from selfrag.pipeline.evaluation.qa_metrics import contains_answer
from selfrag.pipeline.grounding import grounding_score, sentence_share, term_share
from selfrag.pipeline.learning.logistic_fit import auc
from selfrag.pipeline.prompts import passage_text
from selfrag.pipeline.protocols import Generation, Passage
from selfrag.pipeline.scoring import relevance_score, support_score
from selfrag.runtime.system import LocalRuntime

KINDS = ("wrong", "trap", "absent", "swapped")


@dataclass
class Triple:
    kind: str
    branch: Branch
    draft: Generation


def squad_items(data: Path, article: str, n: int, seed: int) -> tuple[list, list, list[str]]:
    """(answerable, unanswerable, other articles' paragraphs): (context, question, answers)."""
    raw = json.loads((data / "squad_v2_small.json").read_text())["data"]
    art = next(a for a in raw if a["title"] == article)
    others = [p["context"] for a in raw if a["title"] != article for p in a["paragraphs"]]
    ans, imp = [], []
    for p in art["paragraphs"]:
        for q in p["qas"]:
            if q.get("is_impossible"):
                imp.append((p["context"], q["question"], []))
            elif q.get("answers"):
                ans.append((p["context"], q["question"], [a["text"] for a in q["answers"]]))
    rng = random.Random(seed)
    rng.shuffle(ans)
    rng.shuffle(imp)
    return ans[:n], imp[:n], others


def passage(text: str, i: int) -> Passage:
    return Passage(id=f"p{i}", text=text, title=None, score=0.0)


def triples(
    critic: Critic,
    tokenize: Callable[[str], list[int]],
    data: Path,
    article: str,
    n: int,
    seed: int,
) -> list[Triple]:
    """The drafted triples of every kind (see the module docstring)."""
    ans, imp, others = squad_items(data, article, n, seed)
    rng = random.Random(seed + 1)
    branches: list[tuple[str, Branch, list[str]]] = []
    for i, (ctx, q, golds) in enumerate(ans):
        branches.append(("gold", Branch(q, "", passage(ctx, i)), golds))
        branches.append(("absent", Branch(q, "", passage(rng.choice(others), 1000 + i)), golds))
    for i, (ctx, q, _) in enumerate(imp):
        branches.append(("trap", Branch(q, "", passage(ctx, 2000 + i)), []))
    out: list[Triple] = []
    for start in range(0, len(branches), 8):
        chunk = branches[start : start + 8]
        drafts = critic.draft([b for _, b, _ in chunk], 48)
        for (kind, b, golds), d in zip(chunk, drafts, strict=True):
            if not d.text.strip():
                continue
            if kind == "gold":
                kind = "supported" if contains_answer(d.text, golds) else "wrong"
            out.append(Triple(kind, b, d))
    answers = [golds[0] for _, _, golds in ans]
    for i, (ctx, q, golds) in enumerate(ans):
        wrong = [a for a in answers if not contains_answer(ctx, [a]) and a not in golds]
        if wrong:
            text = f"The answer is {rng.choice(wrong)}."
            claim = Generation(tokenize(text), text, [], "stop", 0)
            out.append(Triple("swapped", Branch(q, "", passage(ctx, i)), claim))
    return out


def timed(
    fn: Callable[[], list[float]], count: int, clock: dict[str, float], name: str
) -> list[float]:
    t = time.perf_counter()
    values = fn()
    clock[name] = (time.perf_counter() - t) / max(count, 1)
    return values


def score(
    rag: LocalRuntime, critic: Critic, items: Sequence[Triple], judge: LocalRuntime | None = None
) -> tuple[dict, dict]:
    branches = [t.branch for t in items]
    drafts = [t.draft for t in items]
    reader = VerifyReader(rag.engine)
    follow_up = VerifyReader(rag.engine, critic if isinstance(critic, ChatCritic) else None)
    clock: dict[str, float] = {}
    n = len(items)
    source = timed(
        lambda: [support_score(s.probs) for s in critic.support(branches, drafts)],
        n,
        clock,
        "source",
    )
    verify = timed(
        lambda: [v.probs["yes"] for v in reader.read(branches, drafts)], n, clock, "verify"
    )
    followed = timed(
        lambda: [v.probs["yes"] for v in follow_up.read(branches, drafts)],
        n,
        clock,
        "verify_followup",
    )
    relevance = timed(
        lambda: [relevance_score(r.probs) for r in critic.relevance(branches)],
        n,
        clock,
        "relevance",
    )
    if judge is not None:
        other = VerifyReader(judge.engine)
        values_judge = timed(
            lambda: [v.probs["yes"] for v in other.read(branches, drafts)],
            n,
            clock,
            "critic_model",
        )
    evidence = [passage_text(t.branch.passage) for t in items]
    terms = [_or_one(term_share(t.draft.text, e)) for t, e in zip(items, evidence, strict=True)]
    sentence, grounding = (
        [
            _or_one(read(t.draft.text, e, t.branch.question))
            for t, e in zip(items, evidence, strict=True)
        ]
        for read in (sentence_share, grounding_score)
    )
    clock["grounding"] = 0.0
    retrieval = timed(lambda: cosines(rag, items), n, clock, "retrieval")
    values = {
        "source": source,
        "verify": verify,
        "verify_followup": followed,
        "terms": terms,
        "sentence": sentence,
        "grounding": grounding,
        "relevance": relevance,
        "verify*terms": [v * g for v, g in zip(verify, terms, strict=True)],
        "retrieval": retrieval,
        "verify*grounding": [v * g for v, g in zip(verify, grounding, strict=True)],
        "verify*grounding*retrieval": [
            v * g * r for v, g, r in zip(verify, grounding, retrieval, strict=True)
        ],
        "followup*grounding": [v * g for v, g in zip(followed, grounding, strict=True)],
    }
    if judge is not None:
        values["critic_model"] = values_judge
        values["critic_model*grounding"] = [
            v * g for v, g in zip(values_judge, grounding, strict=True)
        ]
    return values, clock


def _or_one(value: float | None) -> float:
    """A grounding read that has nothing to check (None) leaves the product as it is."""
    return 1.0 if value is None else value


def cosines(rag: LocalRuntime, items: Sequence[Triple]) -> list[float]:
    """The embedder's cosine of each triple's question and passage: the dense retriever's score."""
    out = []
    for t in items:
        assert t.branch.passage is not None
        q, p = rag.embedder.embed([t.branch.question, t.branch.passage.text])
        out.append(cosine(q, p))
    return out


def score_heads(rag: LocalRuntime, items: Sequence[Triple], heads: Sequence[Path]) -> tuple:
    """s_sup of each heads file's learned critique on the same triples."""
    from selfrag.infra.models.heads_store import load_heads
    from selfrag.pipeline.critics.learned import LearnedCritic

    branches, drafts = [t.branch for t in items], [t.draft for t in items]
    values: dict[str, list[float]] = {}
    clock: dict[str, float] = {}
    for path in heads:
        critic = LearnedCritic(rag.engine, load_heads(path))
        values[f"heads:{path.stem}"] = timed(
            lambda c=critic: [support_score(s.probs) for s in c.support(branches, drafts)],
            len(items),
            clock,
            f"heads:{path.stem}",
        )
    return values, clock


def report(
    items: Sequence[Triple], values: dict[str, list[float]], clock: dict[str, float]
) -> dict[str, float]:
    kinds = [t.kind for t in items]
    counts = {k: kinds.count(k) for k in ("supported", *KINDS)}
    print("counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    print(f"{'candidate':18s} " + " ".join(f"{k:>8s}" for k in (*KINDS, "all")) + "   s/read")
    figures: dict[str, float] = {}
    for name, vals in values.items():
        pos = [v for v, k in zip(vals, kinds, strict=True) if k == "supported"]
        row = []
        for kind in (*KINDS, "all"):
            neg = [
                v
                for v, k in zip(vals, kinds, strict=True)
                if (k == kind if kind != "all" else k != "supported")
            ]
            a = auc([*pos, *neg], [True] * len(pos) + [False] * len(neg)) if pos and neg else None
            row.append(f"{a:8.3f}" if a is not None else f"{'n/a':>8s}")
            if a is not None:
                figures[f"{name}_{kind}"] = round(a, 3)
        print(f"{name:18s} " + " ".join(row) + f"   {clock.get(name, 0.0):.3f}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--article", default="Normans")
    parser.add_argument("--questions", type=int, default=30)
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write each triple's scores here (JSON)")
    parser.add_argument(
        "--heads", type=Path, nargs="+", help="score only these heads files' s_sup (see above)"
    )
    parser.add_argument(
        "--critic-model",
        help="another preset that reads the verification question too (critic_model: the "
        "larger model as the critic of the served one's drafts)",
    )
    args = parser.parse_args()
    # The data folder's model files and heads; no index is read.
    settings = load_settings(overrides={"model": {"preset": args.model, "support_read": "source"}})
    with LocalRuntime(settings) as rag:
        critic = rag.critic("auto")
        print(f"model {args.model}, critique {critic.name}, article {args.article}")
        items = triples(
            critic, rag.engine.tokenize, args.data, args.article, args.questions, args.seed
        )
        if args.heads:
            values, clock = score_heads(rag, items, args.heads)
        elif args.critic_model:
            judge_settings = load_settings(overrides={"model": {"preset": args.critic_model}})
            with LocalRuntime(judge_settings) as judge:
                values, clock = score(rag, critic, items, judge)
        else:
            values, clock = score(rag, critic, items)
        if args.out is not None:
            rows = [
                {"kind": t.kind, "question": t.branch.question, "draft": t.draft.text}
                | {name: vals[i] for name, vals in values.items()}
                for i, t in enumerate(items)
            ]
            args.out.write_text(json.dumps(rows, indent=1))
        figures = report(items, values, clock)
    figures.update(model=args.model, article=args.article, critique=critic.name)  # type: ignore[arg-type]
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
