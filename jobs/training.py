"""`selfrag train`: fit the reflection heads of a model file on its own hidden states.

Examples come from `pipeline.learning.reflection_data` (self-supervised from the index, plus
labelled QA when given; with a critic model, support labels from it:
`pipeline.learning.critic_labels`); each is turned into the prompt the learned critique reads
at inference (`SequenceCritic`'s layout) and the engine returns the final hidden state there.
Each group is a multinomial logistic regression without bias (rows of the output matrix,
`pipeline.heads`), balanced over the labels present, its L2 strength chosen on a validation
split held out by passage or question.
"""

from __future__ import annotations

import random
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy.optimize import minimize
from tqdm import tqdm

from selfrag.jobs.evaluation.eval_questions import EvalQuestion
from selfrag.pipeline.critics import Branch, ChatCritic, SequenceCritic
from selfrag.pipeline.heads import GROUP_LABELS
from selfrag.pipeline.learning.logistic_fit import auc
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
from selfrag.pipeline.scoring import (
    relevance_score,
    retrieval_probability,
    support_score,
    utility_score,
)

if TYPE_CHECKING:
    from selfrag.pipeline.learning.critic_labels import CriticLabeller
    from selfrag.runtime.system import LocalRuntime

# The fewest examples, and of each group's two contrasted labels, a group trains on.
MIN_EXAMPLES = 20
MIN_PER_LABEL = 5
L2_GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
VALIDATION_SHARE = 0.2
# The labels whose score separation the validation AUC measures, per group.
CONTRAST = {
    "retrieve": ("yes", "no"),
    "relevance": ("relevant", "irrelevant"),
    "support": ("full", "none"),
    "utility": ("5", "1"),
}
SCORE = {
    "retrieve": retrieval_probability,
    "relevance": relevance_score,
    "support": support_score,
    "utility": utility_score,
}


class TrainingError(ValueError):
    """Too little data to train a group, or unusable training input."""


@dataclass(frozen=True)
class TrainingPlan:
    """How many examples to draw; the defaults train on the shared corpus and the Normans
    questions in minutes on 2 cores, most of it the hidden states of the passage prompts
    (docs/benchmarks.md, "`selfrag train` time", has the measured time)."""

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


def fit_softmax(
    X: np.ndarray, y: np.ndarray, n_labels: int, l2: float, sample_weight: np.ndarray
) -> np.ndarray:
    """Weights (n_labels × d) of softmax(W·x) without bias: weighted cross-entropy + l2/2·|W|².

    Features are scaled per dimension (not centred, which would need a bias) for the fit and
    the scale folded back into W.
    """
    scale = np.sqrt((X.astype(np.float64) ** 2).mean(axis=0)) + 1e-6
    Z = X / scale
    Y = np.eye(n_labels)[y]
    w = sample_weight / sample_weight.sum()
    d = Z.shape[1]

    def loss(flat: np.ndarray) -> tuple[float, np.ndarray]:
        W = flat.reshape(n_labels, d)
        logits = Z @ W.T
        logits -= logits.max(axis=1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        value = -(w * (Y * log_p).sum(axis=1)).sum() + 0.5 * l2 * (W * W).sum()
        grad = (np.exp(log_p) - Y).T @ (Z * w[:, None]) + l2 * W
        return float(value), grad.ravel()

    result = minimize(
        loss, np.zeros(n_labels * d), jac=True, method="L-BFGS-B", options={"maxiter": 500}
    )
    return result.x.reshape(n_labels, d) / scale


def probabilities(W: np.ndarray, X: np.ndarray, labels: Sequence[str]) -> list[dict[str, float]]:
    z = X.astype(np.float64) @ W.T.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return [dict(zip(labels, row.tolist(), strict=True)) for row in p]


def group_auc(group: str, W: np.ndarray, X: np.ndarray, labels: Sequence[str]) -> float | None:
    """AUC of the group's score (p_ret, s_rel, s_sup, s_use) for its two contrasted labels."""
    positive, negative = CONTRAST[group]
    keep = [i for i, label in enumerate(labels) if label in (positive, negative)]
    if not keep:
        return None
    probs = probabilities(W, X[keep], GROUP_LABELS[group])
    return auc([SCORE[group](p) for p in probs], [labels[i] == positive for i in keep])


def lowered(W: np.ndarray, X: np.ndarray, ceiling: float = -10.0) -> tuple[np.ndarray, float]:
    """W with every row moved by the same vector −c·μ̂ (μ̂: the mean hidden-state direction) so
    that no row's logit exceeds `ceiling` on the training states. Within-group probabilities
    do not change (softmax ignores a shift common to a group), but as rows of an exported
    output matrix the reflection tokens then stay far below ordinary tokens (whose top logit is
    ~8-25 for SmolLM2) and never interrupt generated text. Returns W and c."""
    mu = X.astype(np.float64).mean(axis=0)
    mu_hat = mu / (np.linalg.norm(mu) + 1e-12)
    along = X.astype(np.float64) @ mu_hat
    if along.min() <= 0.0:
        return W, 0.0  # no direction every state shares: leave the rows as they are
    top = (X.astype(np.float64) @ W.T).max(axis=1)
    c = max(float(((top - ceiling) / along).max()), 0.0)
    return W - c * mu_hat[None, :], c


def is_validation(key: str, seed: int) -> bool:
    """Whether the example about `key` is in the validation split (a fixed share, by key)."""
    return zlib.crc32(f"{seed}:{key}".encode()) % 1000 < VALIDATION_SHARE * 1000


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


def fit_heads(
    examples: Sequence[Example], X: np.ndarray, seed: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Per group: choose L2 on the validation split, refit on all examples. Returns the weights
    (rounded to float16, the precision an exported output matrix keeps) and statistics."""
    weights: dict[str, np.ndarray] = {}
    stats: dict[str, Any] = {}
    for group, labels in GROUP_LABELS.items():
        idx = [i for i, ex in enumerate(examples) if ex.group == group]
        y = np.array([labels.index(examples[i].label) for i in idx])
        names = [examples[i].label for i in idx]
        Xg = X[idx]
        present = Counter(y.tolist())
        sw = np.array([1.0 / present[v] for v in y])
        val = np.array([is_validation(examples[i].key, seed) for i in idx])
        tried: dict[float, float | None] = {}
        for l2 in L2_GRID:
            W = fit_softmax(Xg[~val], y[~val], len(labels), l2, sw[~val])
            tried[l2] = group_auc(
                group, W, Xg[val], [n for n, v in zip(names, val, strict=True) if v]
            )
        best = max(L2_GRID, key=lambda v: (tried[v] or 0.0, v))
        W = fit_softmax(Xg, y, len(labels), best, sw)
        W, shift = lowered(W, X)
        weights[group] = W.astype(np.float16).astype(np.float32)
        stats[group] = {
            "examples": len(idx),
            "labels": {label: int((y == k).sum()) for k, label in enumerate(labels)},
            "sources": dict(Counter(examples[i].source for i in idx)),
            "validation_examples": int(val.sum()),
            "validation_auc": tried[best],
            "l2": best,
            "l2_grid_auc": {str(k): v for k, v in tried.items()},
            "shift": shift,
        }
    return weights, stats


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
        a = s["validation_auc"]
        shown = f"{a:.3f}" if a is not None else "n/a"
        labels = ", ".join(f"{k} {v}" for k, v in s["labels"].items() if v)
        lines.append(f"  {group:<9} {s['examples']:>5} examples ({labels}); validation AUC {shown}")
    if c := manifest.get("critic"):
        lines.append(f"  support labelled by {c['model']} ({c['mode']}): {c['read']} read")
    lines.append(f"  {manifest['seconds']:.0f} s")
    return "\n".join(lines)
