"""Critique benchmark: the prompted, likelihood and learned sources on the same held-out pairs,
and what hidden-state output costs a branch step of the learned critique.

Held-out data: the Computational_complexity_theory article of SQuAD v2 (`squad_v2_small.json`;
the Normans article is the tuning and training split and is never read). With a fixed seed,
`--questions` questions of the article are drawn, answerable and unanswerable alike, and one
draft per question is written from its gold paragraph by the learned critic's draft prompt
(`--draft` tokens). Every source then scores the same pairs, and each group's AUC is
`pipeline.learning.logistic_fit.auc` of its score:

* IsRel (s_rel): for answerable questions, the gold paragraph (positive) against
  `--negatives` other paragraphs of the same article (negative);
* IsSup (s_sup): the draft with its gold paragraph; positive when the question is answerable
  and the draft contains a gold answer, negative otherwise (every draft for an unanswerable
  question is unsupported);
* IsUse (s_use): the same drafts and labels (right vs wrong answers);
* Retrieve (p_ret): for right drafts only, the question with no answer yet (positive: a
  retrieval is needed) against the question with that right draft as the answer so far
  (negative).

An AUC with an empty class is n/a. The model is the configured one (`model.preset`, `model.path`,
`model.weights`). The heads are those of its file (`selfrag train`), or
`--heads PATH`; the likelihood source uses the calibration of the settings' data folder.

Second, one branch step of the learned critique (relevance of K passages, a draft of
`--step-draft` tokens, support and utility) is timed with the engine returning hidden states
(the real `LearnedCritic`) and with the same reads asking for no hidden state (the reads'
vectors replaced by zeros, so only the engine's work differs). The variants alternate over
`--reps` steps, each after `engine.clear_cache()`, so both decode the same tokens from an
empty cache. Reported: median seconds per step of each and their ratio (the target:
under 10% extra). The last line holds the figures as name=value pairs.

    .venv/bin/python -m bench.critique [--data ../shared/data] [--questions 60] [--negatives 2]
                                       [--reps 5] [--threads 2] [--heads PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from bench.kv_cache import branch_step
from selfrag.infra.corpus.reading import Document, read_documents
from selfrag.infra.engine.llama_engine import LlamaEngine
from selfrag.infra.models.heads_store import find_heads, load_heads
from selfrag.infra.models.model_files import derive_weights, file_sha256
from selfrag.infra.models.model_presets import model_title, resolve_model
from selfrag.infra.settings_loader import load_settings
from selfrag.jobs.evaluation.eval_questions import EvalQuestion, load_questions
from selfrag.pipeline.critics import (
    Branch,
    Critic,
    LabelProbs,
    LearnedCritic,
    make_critic,
    read_requests,
)
from selfrag.pipeline.evaluation.qa_metrics import contains_answer
from selfrag.pipeline.heads import HeadsError, ReflectionHeads
from selfrag.pipeline.learning.logistic_fit import auc
from selfrag.pipeline.protocols import Generation, LanguageModel, Passage
from selfrag.pipeline.scoring import (
    relevance_score,
    retrieval_probability,
    support_score,
    utility_score,
)

ARTICLE = "Computational_complexity_theory"
SOURCES = ("prompted", "likelihood", "learned")
GROUPS = ("rel", "sup", "use", "ret")
GROUP_NAMES = {"rel": "IsRel", "sup": "IsSup", "use": "IsUse", "ret": "Retrieve"}

T = TypeVar("T")


class NoHiddenCritic(LearnedCritic):
    """The learned critique with reads that ask the engine for no hidden state: the same
    prompts and decodes, zero vectors in place of the hidden states (timing only)."""

    def __init__(self, model: LanguageModel, heads: ReflectionHeads) -> None:
        super().__init__(model, heads)
        self.engine = model

    def hidden_states(
        self, prompts: Sequence[list[int]], reusable: Sequence[int]
    ) -> list[tuple[tuple[float, ...], int]]:
        if not prompts:
            return []
        requests = read_requests(prompts, reusable, hidden=False)
        zero = (0.0,) * self.heads.hidden_size
        return [(zero, r.prefill_tokens) for r in self.engine.next_token_logprobs(requests)]


def chunked(
    fn: Callable[[list[Branch]], list[T]], branches: Sequence[Branch], size: int
) -> list[T]:
    """`fn` over `branches` in calls of at most `size` (bounds the engine's batch)."""
    out: list[T] = []
    for start in range(0, len(branches), size):
        out += fn(list(branches[start : start + size]))
    return out


def article_passages(path: Path) -> dict[str, Passage]:
    """The held-out article's paragraphs as passages, by document id (as the index names them)."""
    out: dict[str, Passage] = {}
    for doc in read_documents(path):
        if isinstance(doc, Document) and doc.id.startswith(f"squad:{ARTICLE}:"):
            out[doc.id] = Passage(doc.id, doc.text, doc.title)
    return out


def held_out(
    path: Path, n: int, negatives: int, seed: int
) -> tuple[list[EvalQuestion], dict[str, Passage], list[tuple[Branch, bool]]]:
    """`n` questions of the article (seeded draw), its paragraphs, and the IsRel pairs."""
    questions = load_questions(path, article=ARTICLE)
    passages = article_passages(path)
    if len(passages) <= negatives:
        raise SystemExit(f"{path}: {ARTICLE} has {len(passages)} paragraphs, too few")
    rng = random.Random(seed)
    chosen = rng.sample(questions, min(n, len(questions)))
    rel: list[tuple[Branch, bool]] = []
    for q in chosen:
        if not q.answerable:
            continue
        gold = passages[str(q.paragraph_id)]
        others = [p for pid, p in passages.items() if pid != gold.id]
        rel.append((Branch(q.question, "", gold), True))
        rel += [(Branch(q.question, "", p), False) for p in rng.sample(others, negatives)]
    return chosen, passages, rel


def scores(
    critic: Critic,
    rel: Sequence[Branch],
    drafted: Sequence[Branch],
    drafts: Sequence[Generation],
    ret: Sequence[Branch],
    batch: int,
) -> dict[str, list[float]]:
    """Each group's score for every pair, in the order of the pairs."""
    pairs = list(zip(drafted, drafts, strict=True))

    def support(chunk: list[tuple[Branch, Generation]]) -> list[LabelProbs]:
        return critic.support([b for b, _ in chunk], [d for _, d in chunk])

    def utility(chunk: list[tuple[Branch, Generation]]) -> list[LabelProbs]:
        return critic.utility([b for b, _ in chunk], [d for _, d in chunk])

    def over_pairs(
        fn: Callable[[list[tuple[Branch, Generation]]], list[LabelProbs]],
    ) -> list[LabelProbs]:
        out: list[LabelProbs] = []
        for start in range(0, len(pairs), batch):
            out += fn(pairs[start : start + batch])
        return out

    return {
        "rel": [relevance_score(x.probs) for x in chunked(critic.relevance, rel, batch)],
        "sup": [support_score(x.probs) for x in over_pairs(support)],
        "use": [utility_score(x.probs) for x in over_pairs(utility)],
        "ret": [retrieval_probability(x.probs) for x in chunked(critic.retrieval, ret, batch)],
    }


def resolve_heads(arg: Path | None, home: Path, model_path: Path) -> tuple[ReflectionHeads, Path]:
    sha = file_sha256(model_path)
    path = arg if arg is not None else find_heads(home, sha)
    if path is None:
        raise SystemExit(
            f"no reflection heads for {model_path.name} (sha256:{sha}) under {home / 'heads'}: "
            "run `selfrag train` first, or pass --heads PATH"
        )
    try:
        heads = load_heads(path)
        heads.check_model(sha, None)
    except HeadsError as exc:
        raise SystemExit(str(exc)) from exc
    return heads, path


def time_steps(
    engine: LlamaEngine,
    variants: dict[str, LearnedCritic],
    branches: list[Branch],
    draft_tokens: int,
    reps: int,
) -> dict[str, list[tuple[float, list[float], int, int]]]:
    """(seconds, phase seconds, prefill tokens, decode calls) of each step of each variant."""

    def step(critic: LearnedCritic) -> tuple[float, list[float], int, int]:
        engine.clear_cache()  # both variants decode the same prompts from an empty cache
        engine.reset_stats()
        t0 = time.perf_counter()
        phases = branch_step(critic, branches, draft_tokens)
        dt = time.perf_counter() - t0
        s = engine.stats
        return dt, phases, s.prefill_tokens, s.decode_calls

    for critic in variants.values():
        step(critic)  # warm-up: pages in the weights and the embeddings path
    runs: dict[str, list[tuple[float, list[float], int, int]]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(reps):
        # Alternating order (AB, BA, ...) so neither variant always runs first.
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(step(variants[name]))
    return runs


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--questions", type=int, default=60, help="Held-out questions drawn.")
    ap.add_argument("--negatives", type=int, default=2, help="Other paragraphs per IsRel pair.")
    ap.add_argument("--draft", type=int, default=48, help="Draft tokens for the AUC pairs.")
    ap.add_argument("--k", type=int, default=3, help="Passages of the timed branch step.")
    ap.add_argument("--step-draft", type=int, default=16, help="Draft tokens of a timed step.")
    ap.add_argument("--reps", type=int, default=5, help="Timed steps of each variant.")
    ap.add_argument("--threads", type=int, default=2, help="0: all cores.")
    ap.add_argument("--batch", type=int, default=8, help="Branches per engine call.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", type=Path, default=None, help="Heads file (default: the model's).")
    args = ap.parse_args(argv)
    if args.questions < 1 or args.reps < 1 or args.k < 1 or args.negatives < 1:
        ap.error("--questions, --negatives, --k and --reps must be at least 1")

    squad = args.data / "squad_v2_small.json"
    chosen, passages, rel_pairs = held_out(squad, args.questions, args.negatives, args.seed)
    settings = load_settings()
    home = settings.home
    model_path = derive_weights(resolve_model(settings.model, home), settings.model.weights, home)
    heads, heads_file = resolve_heads(args.heads, home, model_path)
    engine = LlamaEngine(
        model_path,
        n_ctx=8192,
        n_seq_max=16,
        n_threads=args.threads,
        n_batch=512,
        model_id=model_title(settings.model),
    )
    try:
        critics = {s: make_critic(engine, s, settings.calibration, heads) for s in SOURCES}
        learned = critics["learned"]
        assert isinstance(learned, LearnedCritic)

        # One draft per question, from its gold paragraph, shared by all three sources.
        drafted = [Branch(q.question, "", passages[str(q.paragraph_id)]) for q in chosen]
        t0 = time.perf_counter()
        drafts = chunked(lambda bs: learned.draft(bs, args.draft), drafted, args.batch)
        right = [
            q.answerable and contains_answer(d.text, q.golds)
            for q, d in zip(chosen, drafts, strict=True)
        ]
        print(f"{len(drafts)} drafts in {time.perf_counter() - t0:.1f} s, {sum(right)} right")
        ret_pairs: list[tuple[Branch, bool]] = []
        for q, d, ok in zip(chosen, drafts, right, strict=True):
            if ok:
                ret_pairs += [(Branch(q.question, "", None), True)]
                ret_pairs += [(Branch(q.question, d.text, None), False)]
        labels = {
            "rel": [y for _, y in rel_pairs],
            "sup": right,
            "use": right,
            "ret": [y for _, y in ret_pairs],
        }
        aucs: dict[str, dict[str, float | None]] = {g: {} for g in GROUPS}
        for source, critic in critics.items():
            t0 = time.perf_counter()
            s = scores(
                critic,
                [b for b, _ in rel_pairs],
                drafted,
                drafts,
                [b for b, _ in ret_pairs],
                args.batch,
            )
            for g in GROUPS:
                aucs[g][source] = auc(s[g], labels[g])
            print(f"{source}: scored in {time.perf_counter() - t0:.1f} s")

        # The timed step: the first answerable question with its gold and k-1 other paragraphs.
        q = next((q for q in chosen if q.answerable), chosen[0])
        gold = passages[str(q.paragraph_id)]
        others = [p for pid, p in passages.items() if pid != gold.id]
        step_passages = [gold, *random.Random(args.seed).sample(others, args.k - 1)]
        branches = [Branch(q.question, "", p) for p in step_passages]
        variants: dict[str, LearnedCritic] = {
            "hidden": learned,
            "plain": NoHiddenCritic(engine, heads),
        }
        runs = time_steps(engine, variants, branches, args.step_draft, args.reps)
    finally:
        engine.close()

    n_unans = sum(not q.answerable for q in chosen)
    print(
        f"\n{ARTICLE}: {len(chosen)} questions ({n_unans} unanswerable), seed {args.seed}, "
        f"{engine.n_threads} thread(s), {model_path.name}, heads {heads_file}"
    )
    print(f"| {'group':9} | {'pos/neg':>9} | " + " | ".join(f"{s:>10}" for s in SOURCES) + " |")
    print(f"|{'-' * 11}|{'-' * 10}:|" + "|".join("-" * 11 + ":" for _ in SOURCES) + "|")
    for g in GROUPS:
        pos = sum(labels[g])
        counts = f"{pos}/{len(labels[g]) - pos}"
        cells = " | ".join(f"{fmt(aucs[g][s]):>10}" for s in SOURCES)
        print(f"| {GROUP_NAMES[g]:9} | {counts:>9} | {cells} |")

    print(
        f"\nbranch step of the learned critique: K={args.k}, draft {args.step_draft} tokens, "
        f"{args.reps} step(s) each, medians"
    )
    print(
        f"{'variant':8} {'step s':>7} {'relevance':>10} {'draft':>7} {'support':>8} "
        f"{'utility':>8} {'prefill tok':>12} {'decodes':>8}"
    )
    medians: dict[str, float] = {}
    for name, rs in runs.items():
        medians[name] = statistics.median(r[0] for r in rs)
        ph = [statistics.median(r[1][i] for r in rs) for i in range(4)]
        print(
            f"{name:8} {medians[name]:>7.3f} {ph[0]:>10.3f} {ph[1]:>7.3f} {ph[2]:>8.3f} "
            f"{ph[3]:>8.3f} {statistics.median(r[2] for r in rs):>12.0f} "
            f"{statistics.median(r[3] for r in rs):>8.0f}"
        )
    overhead = medians["hidden"] / medians["plain"]
    print(f"hidden-state output costs {100 * (overhead - 1):+.1f}% per branch step (target < +10%)")
    figures = [f"auc_{g}_{s}={fmt(aucs[g][s])}" for g in GROUPS for s in SOURCES]
    figures += [
        f"questions={len(chosen)}",
        f"right_drafts={sum(right)}",
        f"step_s_hidden={medians['hidden']:.3f}",
        f"step_s_plain={medians['plain']:.3f}",
        f"hidden_overhead={overhead:.3f}",
    ]
    print(" ".join(figures))


if __name__ == "__main__":
    main()
