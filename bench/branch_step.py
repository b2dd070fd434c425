"""Where the time of a branch step goes: one step of K = 3 evidence branches (relevance read,
draft, support and utility reads) on the learned critique, warm passage states, three ways in
one run, interleaved so that load from other processes hits them alike:

(a) separate: a prompt per question (relevance, draft, support, and utility without the
    passage), each carrying the question and its task;
(b) sequence: one growing sequence per branch (`SequenceCritic`), the hidden state computed
    only at the read positions (the last prompt token decoded in a call of its own);
(c) sequence, all outputs: as (b) with the hidden state switched on for the whole prompt, so
    llama.cpp outputs every position of the batch (`output_all = cparams.embeddings`).

The heads are random rows of the model's hidden size (this measures time, not scores), and
pruning is off so every layout drafts every branch. Each step's wall time is split into
prefill (`llama_decode` calls of several tokens per sequence), decode (one token per sequence),
hidden-state output (calls with embeddings on) and Python (the rest), next to the engine's best
prefill tokens/s and decode ms/token on this CPU. The last line holds the figures as name=value.

    SELFRAG_MODEL__PRESET=smollm2 .venv/bin/python -m bench.branch_step --home /tmp/homecopy
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp

from bench.vs_vanilla import HELD_OUT, engine_reference, held_out_questions
from selfrag.infra.engine import llama_engine
from selfrag.infra.engine.kv_slots import KVJob
from selfrag.pipeline.branching import expand
from selfrag.pipeline.critics import Branch, ChatCritic, LearnedCritic
from selfrag.pipeline.heads import GROUP_LABELS, GroupHead, ReflectionHeads
from selfrag.pipeline.ranking import Candidate
from selfrag.schemas.decoding import DecodingConfig

K = 3
CONFIG = DecodingConfig(
    mode="always", top_k=K, max_segments=1, max_segment_tokens=48, min_relevance=0.0
)


class SeparateLayout(LearnedCritic):
    """The learned critique at the read positions of layout (a): a prompt per question."""

    retrieval_prompt = ChatCritic.retrieval_prompt
    relevance_prompt = ChatCritic.relevance_prompt
    support_prompt = ChatCritic.support_prompt
    utility_prompt = ChatCritic.utility_prompt


@dataclass
class DecodeClock:
    """Seconds inside `llama_decode`, by kind of call, while installed; with `by_sequences`,
    generation steps are told apart by their number of sequences ("step x3")."""

    seconds: dict[str, float] = field(default_factory=dict)
    embeddings: bool = False
    by_sequences: bool = False

    def install(self) -> Callable[[], None]:
        decode, set_embeddings = llama_cpp.llama_decode, llama_cpp.llama_set_embeddings

        def timed_decode(ctx: Any, batch: Any) -> int:
            n = batch.n_tokens
            seqs = {batch.seq_id[i][0] for i in range(n)}
            step = f"step x{len(seqs)}" if self.by_sequences else "decode"
            kind = "hidden" if self.embeddings else (step if n == len(seqs) else "prefill")
            started = time.perf_counter()
            try:
                return int(decode(ctx, batch))
            finally:
                self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - started

        def tracked_embeddings(ctx: Any, on: bool) -> None:
            self.embeddings = bool(on)
            set_embeddings(ctx, on)

        llama_cpp.llama_decode = timed_decode
        llama_cpp.llama_set_embeddings = tracked_embeddings

        def uninstall() -> None:
            llama_cpp.llama_decode, llama_cpp.llama_set_embeddings = decode, set_embeddings

        return uninstall


def all_outputs(on: bool) -> Callable[[], None]:
    """While on, hidden-state reads decode their whole prompt with embeddings on (variant c)."""
    original = llama_engine.KVJob

    @dataclass
    class EveryPosition(KVJob):
        def __post_init__(self) -> None:
            self.last_alone = False

    if on:
        llama_engine.KVJob = EveryPosition  # type: ignore[misc]

    def restore() -> None:
        llama_engine.KVJob = original  # type: ignore[misc]

    return restore


def row(rng: random.Random, n: int) -> tuple[float, ...]:
    return tuple(rng.gauss(0, 0.01) for _ in range(n))


def random_heads(hidden: int) -> ReflectionHeads:
    rng = random.Random(0)
    groups = {
        g: GroupHead(
            labels, tuple(tuple(rng.gauss(0, 0.01) for _ in range(hidden)) for _ in labels)
        )
        for g, labels in GROUP_LABELS.items()
    }
    return ReflectionHeads("0" * 64, groups)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--home", required=True, help="An indexed SELFRAG_HOME (SQuAD + wiki).")
    p.add_argument(
        "--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data"
    )
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)

    from selfrag.infra.settings_loader import load_settings
    from selfrag.runtime.system import LocalRuntime

    settings = load_settings(environ={**os.environ, "SELFRAG_HOME": str(args.home)})
    qs = [q for q, _ in held_out_questions(args.data, args.questions)]
    with LocalRuntime(settings) as rag:
        engine = rag.engine
        assert engine.hidden_size is not None
        heads = random_heads(engine.hidden_size)
        passages = [rag.store.search(q, K) for q in qs]
        variants: dict[str, tuple[LearnedCritic, bool]] = {
            "separate": (SeparateLayout(engine, heads), False),
            "sequence": (LearnedCritic(engine, heads), False),
            "sequence_all_outputs": (LearnedCritic(engine, heads), True),
        }
        walls: dict[str, list[float]] = {v: [] for v in variants}
        split: dict[str, dict[str, float]] = {v: {} for v in variants}
        prefill: dict[str, list[int]] = {v: [] for v in variants}
        for q, ps in zip(qs, passages, strict=True):  # warm the passage states
            expand(LearnedCritic(engine, heads), step(q, ps), CONFIG)
        for _ in range(args.reps):
            for q, ps in zip(qs, passages, strict=True):
                for name, (critic, every) in variants.items():
                    engine.clear_cache()  # each variant starts from the passage-state store
                    clock = DecodeClock()
                    undo = [clock.install(), all_outputs(every)]
                    started = time.perf_counter()
                    try:
                        work = expand(critic, step(q, ps), CONFIG)
                    finally:
                        for u in undo:
                            u()
                    wall = time.perf_counter() - started
                    walls[name].append(wall)
                    prefill[name].append(work.prefill_tokens)
                    for kind, s in clock.seconds.items():
                        split[name][kind] = split[name].get(kind, 0.0) + s
                    inside = sum(clock.seconds.values())
                    split[name]["python"] = split[name].get("python", 0.0) + wall - inside
        reference = engine_reference(engine)

    steps = args.questions * args.reps
    print(f"{args.questions} {HELD_OUT} questions x {args.reps}, K={K}, {settings.model.preset}")
    print(
        f"engine: prefill {reference['prefill_tok_s']:.0f} tokens/s, "
        f"decode {reference['decode_ms_per_token']:.1f} ms/token"
    )
    kinds = ("prefill", "decode", "hidden", "python")
    print(f"{'layout':<22} {'p50 s':>6} {'prefill':>8} " + " ".join(f"{k:>8}" for k in kinds))
    figures = {
        "questions": str(args.questions),
        "prefill_tok_s": f"{reference['prefill_tok_s']:.0f}",
        "decode_ms_per_token": f"{reference['decode_ms_per_token']:.2f}",
    }
    for name in variants:
        ms = {k: 1000 * split[name].get(k, 0.0) / steps for k in kinds}
        p50 = statistics.median(walls[name])
        tokens = statistics.mean(prefill[name])
        print(
            f"{name:<22} {p50:>6.2f} {tokens:>8.0f} " + " ".join(f"{ms[k]:>6.0f}ms" for k in kinds)
        )
        figures[f"{name}_p50_s"] = f"{p50:.3f}"
        figures[f"{name}_prefill"] = f"{tokens:.0f}"
        figures |= {f"{name}_{k}_ms": f"{ms[k]:.0f}" for k in kinds}
    p50s = {name: statistics.median(w) for name, w in walls.items()}
    figures["sequence_over_separate"] = f"{p50s['sequence'] / p50s['separate']:.2f}"
    figures["all_outputs_over_sequence"] = f"{p50s['sequence_all_outputs'] / p50s['sequence']:.2f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


def step(question: str, passages: Sequence[Any]) -> list[Candidate]:
    return [Candidate(0, Branch(question, "", p), True, None) for p in passages]


if __name__ == "__main__":
    raise SystemExit(main())
