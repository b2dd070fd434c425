"""Answers taken in turns: several ways of answering the same held-out questions in one process,
question by question, so that load on the machine hits every way alike (the in-process benches
`decode_threads` and `relevance_reads`)."""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.vs_vanilla import MAX_TOKENS, K, held_out_questions
from selfrag.api import SelfRAG
from selfrag.pipeline.evaluation.baselines import BaselineAnswerer
from selfrag.pipeline.evaluation.qa_metrics import contains_answer
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.decoding import DecodingConfig

Question = tuple[str, tuple[str, ...]]


def parse_turn_args(description: str) -> tuple[argparse.Namespace, list[Question]]:
    """--home, --data and --questions, and the held-out questions they name."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--home", required=True)
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--questions", type=int, default=20)
    args = ap.parse_args()
    return args, held_out_questions(Path(args.data), args.questions)


def vanilla_rag(rag: SelfRAG) -> Callable[[str], AnswerResponse]:
    """Vanilla RAG on `rag`'s engine and index: the top K passages in one prompt."""
    vanilla = BaselineAnswerer(rag.system.engine, rag.system.store)
    config = DecodingConfig(top_k=K, max_segments=1, max_segment_tokens=MAX_TOKENS)
    return lambda question: vanilla.answer(question, config, retrieve=True)


@dataclass
class Turns:
    """Per way: each answer's seconds, and the prefill tokens and right answers summed."""

    walls: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    prefill: collections.Counter[str] = field(default_factory=collections.Counter)
    right: collections.Counter[str] = field(default_factory=collections.Counter)

    def p50(self, way: str) -> float:
        return statistics.median(self.walls[way])


def take_turns(
    rag: SelfRAG,
    questions: Sequence[Question],
    ways: dict[str, Callable[[str], AnswerResponse]],
    before: Callable[[str], None] = lambda way: None,
) -> Turns:
    """Each question answered every way in turn (`before(way)` first), each from an empty KV
    cache: Self-RAG restores its passage states from the memory tier, and no way reuses the
    prompt the way before it computed."""
    turns = Turns()
    for question, golds in questions:
        for way, answer in ways.items():
            before(way)
            rag.system.engine.clear_cache()
            started = time.perf_counter()
            r = answer(question)
            turns.walls[way].append(time.perf_counter() - started)
            turns.prefill[way] += r.usage.prefill_tokens
            turns.right[way] += not r.abstained and contains_answer(r.answer, golds)
    return turns
