"""What reading relevance only where it can decide saves: warm Self-RAG answers with the defaults
(the draft budget admits the retriever's first passage; the others are read only when it reads
under 1 - `draft_order_margin`, the one case in which one of them can be promoted before it)
against the same answers with every passage read (a `min_relevance` of 1e-6: a relevance filter
that prunes nothing, so every passage is read, as before), and vanilla RAG, in one process,
taking turns question by question so that load hits all three alike.

The held-out questions are answered once first (the passage states are then warm in memory),
then each is answered three ways, each from an empty KV cache (Self-RAG restores its passage
states, vanilla RAG computes its whole prompt). Reported per way: p50 and mean seconds, prefill
tokens per answer and accuracy (the two Self-RAG ways draft the same passages, so their answers
agree). Last line: name=value.

    SELFRAG_MODEL__PRESET=qwen2.5-coder-0.5b .venv/bin/python -m bench.relevance_reads --home H
"""

from __future__ import annotations

import statistics

from bench.turns import parse_turn_args, take_turns, vanilla_rag
from bench.vs_vanilla import SELFRAG_CONFIG
from selfrag.api import SelfRAG

EVERY_READ = {"min_relevance": 1e-6}
WAYS = ("selfrag default", "selfrag every passage read", "vanilla")


def main() -> None:
    args, questions = parse_turn_args(__doc__.split("\n\n")[0])
    with SelfRAG.open(args.home, cache={"query": False}) as rag:
        print(f"model {rag.system.engine.model_id}, {len(questions)} questions", flush=True)
        for question, _ in questions:  # every passage state warm in memory
            rag.answer(question, **SELFRAG_CONFIG, **EVERY_READ)
        default, every, vanilla = WAYS
        turns = take_turns(
            rag,
            questions,
            {
                default: lambda q: rag.answer(q, **SELFRAG_CONFIG),
                every: lambda q: rag.answer(q, **SELFRAG_CONFIG, **EVERY_READ),
                vanilla: vanilla_rag(rag),
            },
        )
    n = len(questions)
    print("| way | p50 s | mean s | prefill / answer | accuracy |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for way in WAYS:
        print(
            f"| {way} | {turns.p50(way):.2f} | {statistics.mean(turns.walls[way]):.2f} "
            f"| {turns.prefill[way] / n:.0f} | {turns.right[way] / n:.3f} |"
        )
    p50 = {w: turns.p50(w) for w in WAYS}
    print(
        f"default_over_every_read={p50[default] / p50[every]:.2f} "
        f"default_over_vanilla={p50[default] / p50[vanilla]:.2f} "
        f"every_read_over_vanilla={p50[every] / p50[vanilla]:.2f} "
        f"default_prefill={turns.prefill[default] / n:.0f} "
        f"every_read_prefill={turns.prefill[every] / n:.0f} "
        f"same_accuracy={int(turns.right[default] == turns.right[every])}"
    )


if __name__ == "__main__":
    main()
