"""Which synthetic question form the served critique treats most like a real question.

On one SQuAD article's paragraphs (Normans by default, the tuning article): s_sup of real
questions with their gold paragraph (answerable, and SQuAD's unanswerable questions on the same
paragraph) against synthetic questions drawn from the article's indexed passages in each form
of `pipeline.learning.synthetic_qa` (answerable with their own passage, unanswerable with a near
neighbour lacking the answer). All pairs are read as the calibration job reads them
(`jobs.support_calibration.score_pairs`: relevance, draft, support of a first-step branch) with
the served critic, in one process. Reported per set: s_sup p10/p50/p90 and the AUROC of
answerable vs unanswerable. Last line: name=value.

    OMP_WAIT_POLICY=PASSIVE SELFRAG_MODEL__N_THREADS=1 \\
      .venv/bin/python -m bench.synthetic_questions --home HOME --n 20
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from selfrag.infra.settings_loader import load_settings
from selfrag.jobs.support_calibration import CorpusCalibrationPlan, score_pairs
from selfrag.pipeline.learning.logistic_fit import auc
from selfrag.pipeline.learning.synthetic_qa import (
    STYLES,
    SyntheticPair,
    SyntheticQuestion,
    summary,
    synthetic_pairs,
)
from selfrag.pipeline.protocols import Passage
from selfrag.runtime.system import LocalRuntime

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad_v2_small.json"


def real_pairs(path: Path, article: str, n: int, seed: int) -> list[SyntheticPair]:
    """`n` answerable and `n` unanswerable questions of `article`, each with its paragraph."""
    data = json.loads(path.read_text())
    [art] = [a for a in data["data"] if a["title"] == article]
    pairs = []
    for i, para in enumerate(art["paragraphs"]):
        gold = Passage(f"gold{i}", " ".join(para["context"].split()), article.replace("_", " "))
        for q in para["qas"]:
            question = SyntheticQuestion(q["question"], "", "real", gold)
            pairs.append(SyntheticPair(question, gold, not q.get("is_impossible", False)))
    random.Random(seed).shuffle(pairs)
    return [p for p in pairs if p.answerable][:n] + [p for p in pairs if not p.answerable][:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, required=True, help="A home indexing the article.")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--article", default="Normans")
    parser.add_argument("--n", type=int, default=20, help="Questions per set and kind.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = load_settings(overrides={"home": str(args.home)})
    plan = CorpusCalibrationPlan()
    prefix = f"squad:{args.article}:"
    results: dict[str, float | None] = {}
    with LocalRuntime(settings) as rag:
        passages = sorted(
            (p for p in rag.store.passages() if p.id.startswith(prefix)), key=lambda p: p.id
        )
        if not passages:
            raise SystemExit(f"no passages of {args.article} in {args.home}")
        sets = {"real": real_pairs(args.data, args.article, args.n, args.seed)}
        for style in STYLES:
            rng = random.Random(args.seed)
            sets[style] = synthetic_pairs(passages, rag.store.search, args.n, rng, style)  # type: ignore[arg-type]
        for name, pairs in sets.items():
            scores = score_pairs(rag, "auto", pairs, plan, progress=False)
            ans = [s.s_sup for s in scores if s.pair.answerable and s.s_sup is not None]
            una = [s.s_sup for s in scores if not s.pair.answerable and s.s_sup is not None]
            area = auc(ans + una, [True] * len(ans) + [False] * len(una))
            a, u = summary(ans), summary(una)
            print(
                f"{name:<6} answerable p10/p50/p90 {a.get('p10')}/{a.get('p50')}/{a.get('p90')}"
                f"  unanswerable {u.get('p10')}/{u.get('p50')}/{u.get('p90')}  AUROC {area}"
            )
            results[f"{name}_p50"] = a.get("p50")  # type: ignore[assignment]
            results[f"{name}_auroc"] = round(area, 3) if area is not None else None
    print(" ".join(f"{k}={v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
