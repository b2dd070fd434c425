"""Relevance head noise: what each L2 strength of the learned relevance head trades between
ranking and stability under llama.cpp's decode splits.

Builds the relevance examples `selfrag train` builds (inverse-cloze passages of the index
with hard negatives, and the tuning article's retrieved, gold and sibling paragraphs),
reads each example's hidden state twice, once through the engine as training reads it and
once on a bare context with the passage head decoded first and the rest after it
(`bench.read_noise.RawDecoder`), and fits a head per L2 of `jobs.head_fitting`'s grid on the
engine's reads of the training split. Printed per L2: the weight norm, the validation AUC on
either read, and how far s_rel moves between the two reads over all examples (median, 90th
percentile, max). Last line: name=value.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.relevance_head_noise --home H
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.read_noise import DEFAULT_DATA, TUNING_ARTICLE, RawDecoder

GROUP = "relevance"


def _shown(value: float | None) -> str:
    """An AUC to three decimals; "-" where the validation split lacks a label."""
    return "-" if value is None else f"{value:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True)
    parser.add_argument("--model", default=None, help="a preset; default: the configured one")
    parser.add_argument(
        "--passages", type=int, default=None, help="inverse-cloze passages (default: training's)"
    )
    parser.add_argument("--questions", type=int, default=None, help="tuning questions kept")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args(argv)

    from selfrag import SelfRAG
    from selfrag.jobs.evaluation.eval_questions import load_questions
    from selfrag.jobs.head_fitting import L2_GRID, GroupData, probabilities
    from selfrag.jobs.training import TrainingPlan, corpus_examples, hidden_features, qa_relevance
    from selfrag.pipeline.critics import SequenceCritic
    from selfrag.pipeline.heads import GROUP_LABELS
    from selfrag.pipeline.scoring import relevance_score

    plan = TrainingPlan()
    if args.passages is not None:
        plan = dataclasses.replace(plan, relevance_passages=args.passages)
    questions = load_questions(
        args.data / "squad_v2_small.json", article=TUNING_ARTICLE, limit=args.questions
    )
    model = {"preset": args.model} if args.model else {}
    with SelfRAG.open(args.home, model=model, cache={"query": False}) as rag:
        system = rag.system
        engine = system.model.engine
        reader = SequenceCritic(engine)
        passages = list(system.store.passages())
        examples = [
            ex
            for ex in corpus_examples(passages, system.store.search, plan, random.Random(plan.seed))
            if ex.group == GROUP
        ]
        examples += qa_relevance(questions, system.store.search, plan)[0]
        engine_reads = hidden_features(engine, reader, examples, progress=False)
        prompts = [reader.relevance_prompt(ex.branch) for ex in examples]
        path = system.model.path
    decoder = RawDecoder(path)
    split_reads = np.array([decoder.last(tokens, [head])[0] for tokens, head in prompts])

    data = GroupData.of(GROUP, examples, engine_reads, plan.seed)
    drift = np.linalg.norm(engine_reads - split_reads, axis=1) / np.linalg.norm(
        engine_reads, axis=1
    )

    def s_rel(W: np.ndarray, X: np.ndarray) -> np.ndarray:
        return np.array([relevance_score(p) for p in probabilities(W, X, GROUP_LABELS[GROUP])])

    print(
        f"{len(examples)} examples ({dict(Counter(ex.label for ex in examples))}), "
        f"hidden state drift median {np.median(drift):.4f}, max {drift.max():.4f}\n"
    )
    print(
        "| L2 | weight norm | AUC, engine read | AUC, other split | s_rel change: median "
        "| p90 | max |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    figures: dict[str, object] = {
        "examples": len(examples),
        "drift_median": f"{np.median(drift):.4f}",
    }
    for l2 in L2_GRID:
        W = data.fit_training(l2)
        auc_engine = _shown(data.validation_auc(W))
        auc_split = _shown(data.validation_auc(W, split_reads))
        moved = np.abs(s_rel(W, engine_reads) - s_rel(W, split_reads))
        norm = float(np.linalg.norm(W[0] - W[1]))
        print(
            f"| {l2:g} | {norm:.2f} | {auc_engine} | {auc_split} | "
            f"{np.median(moved):.3f} | {np.quantile(moved, 0.9):.3f} | {moved.max():.3f} |"
        )
        figures[f"l2_{l2:g}_auc"] = auc_engine
        figures[f"l2_{l2:g}_moved_p90"] = f"{np.quantile(moved, 0.9):.3f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
