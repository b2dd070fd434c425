"""`selfrag train`: fit the reflection heads of a model file on its own hidden states.

Examples come from `pipeline.learning.reflection_data` (self-supervised from the index, plus
labelled QA when given; with a critic model, support labels from it:
`pipeline.learning.critic_labels`); each is turned into the prompt the learned critique reads
at inference (`SequenceCritic`'s layout) and the engine returns the final hidden state there;
`jobs.head_fitting` fits each group's head on those states.
"""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from selfrag.jobs.evaluation.eval_questions import EvalQuestion
from selfrag.jobs.head_fitting import CONTRAST, fit_heads
from selfrag.pipeline.critics import Branch, ChatCritic, SequenceCritic
from selfrag.pipeline.heads import GROUP_LABELS
from selfrag.pipeline.learning.reflection_data import (
    EntityPool,
    Example,
    inverse_cloze,
    qa_draft_examples,
    qa_relevance_examples,
    retrieve_examples,
    support_examples,
    utility_examples,
)
from selfrag.pipeline.protocols import Generation, LanguageModel, Passage, TokenScoreRequest

if TYPE_CHECKING:
    from selfrag.pipeline.learning.critic_labels import CriticLabeller
    from selfrag.runtime.system import LocalRuntime

# The fewest examples, and of each group's two contrasted labels, a group trains on.
MIN_EXAMPLES = 20
MIN_PER_LABEL = 5


class TrainingError(ValueError):
    """Too little data to train a group, or unusable training input."""


@dataclass(frozen=True)
class TrainingPlan:
    """How many examples to draw; the defaults train on the shared corpus and the Normans
    questions in minutes on 2 cores, most of it the hidden states of the passage prompts
    (notes/benchmarks.md, "`selfrag train` time", has the measured time)."""

    seed: int = 0
    relevance_passages: int = 120
    support_passages: int = 60
    utility_passages: int = 40
    retrieve_passages: int = 40
    hard_negative_depth: int = 4
    qa_negatives: int = 1
    """Per answerable question: retrieved non-gold passages, and as many other paragraphs of
    the same article (SQuAD), as irrelevant examples."""
    draft_tokens: int = 48
    batch: int = 8


def corpus_examples(
    passages: Sequence[Passage],
    search: Callable[[str, int], list[Passage]],
    plan: TrainingPlan,
    rng: random.Random,
) -> list[Example]:
    """The self-supervised examples of every group from the indexed passages."""
    order = list(passages)
    rng.shuffle(order)
    pool = EntityPool.from_texts([p.text for p in passages])

    def hard_negative(query: str, own: Passage) -> Passage | None:
        for p in search(query, plan.hard_negative_depth):
            if p.id != own.id and p.title != own.title:
                return p
        return None

    out = inverse_cloze(order[: plan.relevance_passages], rng, hard_negative)
    out += support_examples(order[: plan.support_passages], order, rng, pool)
    out += utility_examples(order[: plan.utility_passages], order, rng)
    out += retrieve_examples(order[: plan.retrieve_passages], rng)
    return out


def qa_examples(
    critic: ChatCritic,
    questions: Sequence[EvalQuestion],
    search: Callable[[str, int], list[Passage]],
    plan: TrainingPlan,
    *,
    progress: bool,
) -> list[Example]:
    """Labelled examples: retrieved passages for IsRel, and the critic's own drafts from the
    evidence passage (the gold paragraph, else the best retrieved) for IsSup and IsUse."""
    out, todo = qa_relevance(questions, search, plan)
    bar = tqdm(total=len(todo), desc="drafts", file=sys.stderr, disable=not progress)
    for start in range(0, len(todo), plan.batch):
        chunk = todo[start : start + plan.batch]
        drafts = critic.draft([Branch(q.question, "", p) for q, p in chunk], plan.draft_tokens)
        for (q, p), d in zip(chunk, drafts, strict=True):
            out += qa_draft_examples(q.id, q.question, q.golds, q.answerable, p, d.text)
        bar.update(len(chunk))
    bar.close()
    return out


def qa_relevance(
    questions: Sequence[EvalQuestion],
    search: Callable[[str, int], list[Passage]],
    plan: TrainingPlan,
) -> tuple[list[Example], list[tuple[EvalQuestion, Passage]]]:
    """The IsRel examples of labelled questions (retrieved passages, and for an answerable
    question its gold paragraph and as many others of its article), and each question's
    evidence passage (the gold paragraph, else the best retrieved) for its drafts."""
    out: list[Example] = []
    todo: list[tuple[EvalQuestion, Passage]] = []
    rng = random.Random(plan.seed)
    articles: dict[str, dict[str, Passage]] = {}
    for q in questions:
        gold = _gold_passage(q)
        if gold is not None and q.article is not None:
            articles.setdefault(q.article, {})[gold.id] = gold
    for q in questions:
        gold = _gold_passage(q)
        retrieved = [
            p for p in search(q.question, plan.qa_negatives + 1) if gold is None or p.id != gold.id
        ][: plan.qa_negatives + (1 if gold is None else 0)]
        if q.answerable:
            out += qa_relevance_examples(q.id, q.question, q.golds, retrieved)
            if gold is not None:
                # Other paragraphs of the same article: on-topic, the hardest negatives.
                siblings = [
                    p for pid, p in articles.get(q.article or "", {}).items() if pid != gold.id
                ]
                same = rng.sample(siblings, min(plan.qa_negatives, len(siblings)))
                out += qa_relevance_examples(q.id, q.question, q.golds, [gold, *same])
        evidence = gold or (retrieved[0] if retrieved else None)
        if evidence is not None:
            todo.append((q, evidence))
    return out, todo


def _gold_passage(q: EvalQuestion) -> Passage | None:
    if q.context is None or q.paragraph_id is None:
        return None
    title = q.article.replace("_", " ") if q.article else None
    return Passage(id=q.paragraph_id, text=" ".join(q.context.split()), title=title)


def example_prompt(critic: ChatCritic, model: LanguageModel, ex: Example) -> tuple[list[int], int]:
    """The prompt after which the learned critique reads `ex.group`, and its reusable prefix."""
    if ex.group == "retrieve":
        return critic.retrieval_prompt(ex.branch), 0
    if ex.group == "relevance":
        return critic.relevance_prompt(ex.branch)
    tokens = model.tokenize(ex.answer, special=False)
    draft = Generation(tokens, ex.answer, [0.0] * len(tokens), "sentence", 0)
    if ex.group == "support":
        return critic.support_prompt(ex.branch, draft)
    return critic.utility_prompt(ex.branch, draft)


def hidden_features(
    model: LanguageModel,
    critic: ChatCritic,
    examples: Sequence[Example],
    *,
    batch: int = 8,
    progress: bool = True,
) -> np.ndarray:
    """The final hidden state at each example's read position (examples × hidden)."""
    prompts = [example_prompt(critic, model, ex) for ex in examples]
    # Neighbours sharing a passage reuse its KV cells from the engine's prefix cache.
    order = sorted(range(len(examples)), key=lambda i: (prompts[i][0][: prompts[i][1]], i))
    out = np.zeros((len(examples), model.hidden_size or 0), dtype=np.float32)
    bar = tqdm(total=len(order), desc="hidden states", file=sys.stderr, disable=not progress)
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        requests = [
            TokenScoreRequest(prompts[i][0], (), prompts[i][1], hidden_state=True) for i in idx
        ]
        for i, r in zip(idx, model.next_token_logprobs(requests), strict=True):
            assert r.hidden_state is not None
            out[i] = r.hidden_state
        bar.update(len(idx))
    bar.close()
    return out


def check_counts(examples: Sequence[Example]) -> dict[str, Counter[str]]:
    counts: dict[str, Counter[str]] = {g: Counter() for g in GROUP_LABELS}
    for ex in examples:
        counts[ex.group][ex.label] += 1
    for group, c in counts.items():
        total = sum(c.values())
        contrast = CONTRAST[group]
        if total < MIN_EXAMPLES or any(c[label] < MIN_PER_LABEL for label in contrast):
            got = ", ".join(f"{label} {c[label]}" for label in GROUP_LABELS[group])
            raise TrainingError(
                f"the corpus is too small to train the {group!r} head: it got {total} examples "
                f"({got}); it needs {MIN_EXAMPLES}, with at least {MIN_PER_LABEL} each of "
                f"{' and '.join(contrast)}. Index more passages or pass labelled questions (--qa)"
            )
    return counts


def train(
    rag: LocalRuntime,
    questions: Sequence[EvalQuestion],
    plan: TrainingPlan,
    *,
    data: dict[str, Any],
    passages: Sequence[Passage] | None = None,
    progress: bool = True,
    critic: CriticLabeller | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Build the examples, read the hidden states and fit every head; returns weights and the
    manifest. The self-supervised examples come from `passages` (default: the whole index);
    hard negatives are searched in the whole index either way. `critic` labels the support
    examples and the model's drafts on synthetic pairs of `passages`."""
    engine = rag.engine
    if engine.hidden_size is None:
        raise TrainingError("this engine returns no hidden states: train on the llama.cpp backend")
    started = time.monotonic()
    rng = random.Random(plan.seed)
    passages = list(passages) if passages is not None else list(rag.store.passages())
    if not passages:
        raise TrainingError("no passages to train on: run `selfrag index` (or pass --corpus) first")
    reader = SequenceCritic(engine)
    examples = corpus_examples(passages, rag.store.search, plan, rng)
    if questions:
        examples += qa_examples(reader, questions, rag.store.search, plan, progress=progress)
    labelled = None
    if critic is not None:
        examples, labelled = critic(examples, reader, passages, rag.store.search, plan.seed)
    counts = check_counts(examples)
    X = hidden_features(engine, reader, examples, batch=plan.batch, progress=progress)
    weights, stats = fit_heads(examples, X, plan.seed)
    manifest = {
        "model_file": rag.model.path.name,
        "hidden_size": engine.hidden_size,
        "seed": plan.seed,
        "plan": plan.__dict__,
        "data": {
            **data,
            "indexed_passages": rag.store.count(),
            "self_supervised_passages": len(passages),
            "qa_questions": len(questions),
        },
        "counts": {g: dict(c) for g, c in counts.items()},
        "groups": stats,
        "critic": labelled,
        "seconds": round(time.monotonic() - started, 1),
    }
    return weights, manifest


def describe(manifest: dict[str, Any], path: Path) -> str:
    lines = [f"reflection heads for {manifest['model_file']} -> {path}"]
    for group, s in manifest["groups"].items():
        a, best = s["validation_auc"], s.get("validation_auc_best")
        shown = f"{a:.3f} at L2 {s['l2']:g}" if a is not None else "n/a"
        if a is not None and best is not None and best > a:
            shown += f" (best {best:.3f}, standard error {s['validation_auc_error']:.3f})"
        labels = ", ".join(f"{k} {v}" for k, v in s["labels"].items() if v)
        lines.append(f"  {group:<9} {s['examples']:>5} examples ({labels}); validation AUC {shown}")
    if c := manifest.get("critic"):
        lines.append(f"  support labelled by {c['model']} ({c['mode']}): {c['read']} read")
    lines.append(f"  {manifest['seconds']:.0f} s")
    return "\n".join(lines)
