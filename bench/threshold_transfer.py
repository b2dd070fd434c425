"""What the calibrated support threshold abstains on among real, labelled questions.

`selfrag calibrate` fits `min_support_score` on synthetic questions drawn from the index, so
that at most a budget of their answerable pairs abstains. Whether that budget holds for a
user's questions depends on how much they resemble the synthetic ones. This answers a labelled
question set (SQuAD JSON or JSONL of `{question, golden_answers}`) with the threshold off and
reads each answer's `support`, the number the threshold is compared with (an answer whose
first step retrieved abstains exactly when it is None or below the threshold). Reported: the
calibration's threshold and its synthetic answerable quantiles; the real answerable and
unanswerable questions' quantiles; the share of each the calibrated threshold abstains on; and
the threshold the same budget on the real answerable questions would have given. Questions
whose first step did not retrieve are counted apart (the threshold does not apply to them).
On a home of several corpus files, whose answers hold each passage to its own file's
threshold, this reads the lowest (`min_support_score`) for all, and says so.
Last line: name=value.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.threshold_transfer --home HOME \\
      ../shared/data/squad_v2_small.json --article Normans --limit 100
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from pathlib import Path

from selfrag.api import SelfRAG
from selfrag.jobs.evaluation.eval_questions import load_questions
from selfrag.pipeline.learning.synthetic_qa import choose_threshold, summary, threshold_effect


def quantiles(s: Mapping[str, float | int]) -> str:
    """p10/p25/p50 of a `summary` (a calibration's saved one, or one of scores), '-' where
    it has none."""
    return "/".join(str(s.get(k, "-")) for k in ("p10", "p25", "p50"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--home", type=Path, required=True, help="A calibrated home.")
    parser.add_argument("--article", default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--model", default=None, help="A preset; default: the home's setting.")
    args = parser.parse_args()
    questions = load_questions(args.dataset, article=args.article, limit=args.limit)
    overrides = {"model": {"preset": args.model}} if args.model else {}
    with SelfRAG.open(args.home, **overrides) as rag:
        critique = rag.system.critique_name(rag.settings.decoding.critique)
        cal = rag.system.calibrated.calibration(critique)
        if cal is None:
            sys.exit(f"no support calibration for {critique} in {args.home}: run selfrag calibrate")
        answerable: list[float] = []
        unanswerable: list[float] = []
        closed_book = 0
        for q in questions:
            r = rag.answer(q.question, min_support_score=0.0)
            if r.usage.retrievals == 0:
                closed_book += 1
                continue
            (answerable if q.answerable else unanswerable).append(
                -math.inf if r.support is None else r.support
            )
    if not answerable:
        sys.exit("no answerable question retrieved: nothing to compare")
    fitted = threshold_effect(cal.min_support_score, answerable, unanswerable)
    real = choose_threshold(answerable, unanswerable, cal.max_answerable_abstain)
    finite = [s for s in answerable if math.isfinite(s)]
    print(
        f"calibration ({critique}): threshold {cal.min_support_score:.4f} at a budget of "
        f"{cal.max_answerable_abstain:.0%}; synthetic answerable p10/p25/p50 "
        f"{quantiles(cal.answerable)}"
    )
    if len(own := cal.corpus_thresholds()) > 1:
        print(
            "note: answers hold each corpus file's passages to its own threshold ("
            + ", ".join(f"{name} {t:.4f}" for name, t in sorted(own.items()))
            + "); this reads the lowest for all"
        )
    print(
        f"real answerable n={len(answerable)} p10/p25/p50 {quantiles(summary(finite))}; "
        f"unanswerable n={len(unanswerable)} p10/p25/p50 "
        f"{quantiles(summary([s for s in unanswerable if math.isfinite(s)]))}; "
        f"{closed_book} did not retrieve"
    )
    unans = fitted.unanswerable_abstain
    print(
        f"the calibrated threshold abstains on {fitted.answerable_abstain:.1%} of the real "
        f"answerable questions and {'-' if unans is None else f'{unans:.1%}'} of the "
        f"unanswerable; the budget on the real answerable ones gives {real.threshold:.4f}"
    )
    print(
        f"threshold={cal.min_support_score:.4f} real_threshold={real.threshold:.4f} "
        f"answerable_abstain={fitted.answerable_abstain:.3f} "
        f"unanswerable_abstain={'-' if unans is None else f'{unans:.3f}'}"
    )


if __name__ == "__main__":
    main()
