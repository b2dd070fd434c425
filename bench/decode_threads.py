"""Threads per llama.cpp call (`model.adaptive_threads`): warm Self-RAG and vanilla RAG answers
with every call on all threads against small calls on one thread where that measured faster,
in one process, taking turns question by question so that load hits both alike.

The held-out questions are answered once first (the passage states are then warm in memory),
then each is answered four ways, each from an empty KV cache (Self-RAG restores its passage
states, vanilla RAG computes its prompt): Self-RAG and vanilla RAG (`pipeline.evaluation.baselines`,
the same
engine), each with adaptive threads off and on. Reported per way: p50 and mean seconds, and the
seconds inside `llama_decode` by kind of call (prefill, hidden-state reads, generation steps
by number of sequences; `bench.branch_step.DecodeClock`), next to the thread count the engine
chose for each call size. The thread count changes at most the last digits of a score, so the
accuracies of the two settings agree but for a greedy near-tie. Last line: name=value.

    SELFRAG_MODEL__PRESET=smollm2 .venv/bin/python -m bench.decode_threads --home /tmp/h
"""

from __future__ import annotations

import statistics

from bench.branch_step import DecodeClock
from bench.turns import parse_turn_args, take_turns, vanilla_rag
from bench.vs_vanilla import SELFRAG_CONFIG
from selfrag.api import SelfRAG

WAYS = ("selfrag fixed", "selfrag adaptive", "vanilla fixed", "vanilla adaptive")


def main() -> None:
    args, questions = parse_turn_args(__doc__.split("\n\n")[0])
    clock = DecodeClock(by_sequences=True)
    clock.install()
    with SelfRAG.open(args.home, cache={"query": False}) as rag:
        engine = rag.system.engine
        print(f"model {engine.model_id}, {engine.n_threads} threads", flush=True)
        for question, _ in questions:  # warm the passage states and the thread choice
            rag.answer(question, **SELFRAG_CONFIG)
        # Counted from here: the warm-up is not.
        seconds: dict[str, dict[str, float]] = {w: {} for w in WAYS}

        def before(way: str) -> None:
            clock.seconds = seconds[way]
            engine.adaptive_threads = way.endswith("adaptive")

        vanilla = vanilla_rag(rag)
        ways = {
            w: (lambda q: rag.answer(q, **SELFRAG_CONFIG)) if w.startswith("selfrag") else vanilla
            for w in WAYS
        }
        turns = take_turns(rag, questions, ways, before)
        choice = engine.thread_choice()
    n = len(questions)
    print("| way | p50 s | mean s | accuracy | llama_decode s per answer by call |")
    print("| --- | ---: | ---: | ---: | --- |")
    for way in WAYS:
        split = ", ".join(f"{k} {v / n:.3f}" for k, v in sorted(seconds[way].items()))
        print(
            f"| {way} | {turns.p50(way):.2f} | {statistics.mean(turns.walls[way]):.2f} "
            f"| {turns.right[way] / n:.3f} | {split} |"
        )
    print("threads chosen by call size (tokens: threads):", choice)
    p50 = {w: turns.p50(w) for w in WAYS}
    print(
        f"selfrag_adaptive_over_fixed={p50['selfrag adaptive'] / p50['selfrag fixed']:.2f} "
        f"vanilla_adaptive_over_fixed={p50['vanilla adaptive'] / p50['vanilla fixed']:.2f} "
        f"selfrag_over_vanilla_fixed={p50['selfrag fixed'] / p50['vanilla fixed']:.2f} "
        f"selfrag_over_vanilla_adaptive={p50['selfrag adaptive'] / p50['vanilla adaptive']:.2f} "
        f"same_accuracy={int(turns.right['selfrag fixed'] == turns.right['selfrag adaptive'])}"
    )


if __name__ == "__main__":
    main()
