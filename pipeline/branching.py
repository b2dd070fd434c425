"""One decoding step's branch work: relevance, pruning, drafting and critique of every branch.

This is what the branch-generation pool does for a step, in one call: every evidence branch is
read for relevance and pruned under `min_relevance` (or `relevance_margin` below the best
passage of its hypothesis, or past the first `max_drafts` in `draft_order`) before it drafts;
without a relevance filter, only the branches that the budget admits, or that could be promoted
past them, are read;
a branch the hard filters would reject whatever it drafts is skipped; the rest draft a segment (a
no-retrieval branch reuses the closed-book draft its retrieval decision was read from, when
there is one; a draft that only repeats the question drafts again, past its echo; one stuck in a
loop counts as drafting nothing); drafts are critiqued for support (evidence branches) and
utility. A hypothesis whose drafts all fail the hard filters (or, with `retry_flagged`, all
pass them flagged; or, past its first segment, would be dropped) drafts its next passage,
one at a time, up to `retry_drafts` more: the budget's passages past the first cost only where
the first failed.
What comes back is small: `Drafted` scores for the ranker, and the step's token counts.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from selfrag.pipeline.critics import Branch, Critic, LabelProbs
from selfrag.pipeline.protocols import Generation
from selfrag.pipeline.ranking import (
    Candidate,
    Drafted,
    certainly_filtered,
    drops_later_segment,
    passes_filters,
    segment_flags,
)
from selfrag.pipeline.scoring import relevance_score, support_score
from selfrag.pipeline.segmenting import loops, restates_question
from selfrag.pipeline.timings import timed
from selfrag.schemas.decoding import DecodingConfig


@dataclass
class StepWork:
    """The branch work of one step: drafted branches and what they cost."""

    drafted: list[Drafted] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    pruned: int = 0
    filtered: int = 0
    """Branches the hard filters would reject whatever they draft: skipped before drafting."""
    timings_ms: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class BranchWorker(Protocol):
    """Where a step's critique work runs, as the decoder asks for it: the retrieval decision
    for the live hypotheses, and the branch work (`expand`). `LocalBranchWorker` runs both on
    a `Critic` of this process; the Serve ingress's `PoolBranchWorker` sends them to the
    decider and the pool."""

    name: str

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]: ...

    def expand(self, candidates: Sequence[Candidate], cfg: DecodingConfig) -> StepWork: ...


def reusable_draft(g: Generation | None, max_tokens: int) -> Generation | None:
    """A closed-book draft that is what drafting with `max_tokens` would give: it ended on
    its own within the budget, or it was cut at exactly this budget."""
    if g is None or len(g.tokens) > max_tokens:
        return None
    if g.finish_reason == "length" and len(g.tokens) != max_tokens:
        return None
    return g


def pruned_by_relevance(c: Candidate, best: dict[int, float], cfg: DecodingConfig) -> bool:
    """Whether `c` is pruned before drafting: s_rel under `min_relevance`, or more than
    `relevance_margin` below `best[parent]`, the best s_rel of its hypothesis."""
    if c.rel is None:
        return False
    s_rel = candidate_relevance(c)
    if s_rel < (cfg.min_relevance or 0.0):
        return True
    return cfg.relevance_margin is not None and s_rel < best[c.parent] - cfg.relevance_margin


def draft_order(evidence: Sequence[Candidate], margin: float) -> list[Candidate]:
    """`evidence` (in the retriever's order per hypothesis) in the order it drafts under a
    budget: the retriever's, except that a branch whose s_rel is more than `margin` above that
    of its hypothesis's first retrieved passage goes first, the most relevant first."""
    first: dict[int, float] = {}
    for c in evidence:
        first.setdefault(c.parent, candidate_relevance(c))
    promoted = [c for c in evidence if candidate_relevance(c) > first[c.parent] + margin]
    # A stable sort: equal s_rel (a saturated read) leaves the retriever's order.
    promoted.sort(key=candidate_relevance, reverse=True)
    chosen = {id(c) for c in promoted}
    return promoted + [c for c in evidence if id(c) not in chosen]


def candidate_relevance(c: Candidate) -> float:
    """s_rel of `c`'s relevance read (`scoring.relevance_score`); 0 for a branch without one."""
    return relevance_score(c.rel.probs) if c.rel is not None else 0.0


def first_of_each_hypothesis(candidates: Sequence[Candidate], n: int) -> list[Candidate]:
    """The first `n` of `candidates` of each hypothesis, in their order: what a draft budget
    of `n` admits."""
    taken = Counter[int]()
    out = []
    for c in candidates:
        if taken[c.parent] < n:
            taken[c.parent] += 1
            out.append(c)
    return out


def relevance_filtered(cfg: DecodingConfig) -> bool:
    """Whether a relevance filter is on (`min_relevance`, `relevance_margin` under 1,
    `require_relevant`): then every passage's s_rel can keep it from drafting."""
    return (
        bool(cfg.min_relevance)
        or (cfg.relevance_margin is not None and cfg.relevance_margin < 1.0)
        or cfg.require_relevant
    )


def read_relevance(
    critic: Critic, evidence: Sequence[Candidate], cfg: DecodingConfig, work: StepWork
) -> list[Candidate]:
    """Read s_rel of the `evidence` branches (in the retriever's order per hypothesis) whose
    reading can change what drafts, and return the others, which cannot draft. Under a
    relevance filter that is all of them. Otherwise the first `max_drafts` of each hypothesis
    are read; the rest only where the first reads under 1 - `draft_order_margin`, the one case
    in which another passage can be promoted before it (`draft_order`: s_rel is at most 1)."""

    if relevance_filtered(cfg):
        read_each(critic, evidence, work)
        return []
    first = first_of_each_hypothesis(evidence, cfg.max_drafts)
    read_each(critic, first, work)
    leaders: dict[int, float] = {}
    for c in first:
        leaders.setdefault(c.parent, candidate_relevance(c))
    contested = {p for p, s_rel in leaders.items() if s_rel + cfg.draft_order_margin < 1.0}
    read_each(critic, [c for c in evidence if c.rel is None and c.parent in contested], work)
    return [c for c in evidence if c.rel is None]


def read_each(critic: Critic, evidence: Sequence[Candidate], work: StepWork) -> None:
    """Read s_rel of every `evidence` branch, in one call."""
    if evidence:
        rels = critic.relevance([c.branch for c in evidence])
        for c, rel in zip(evidence, rels, strict=True):
            c.rel = rel
            work.prefill_tokens += rel.prefill_tokens


def within_draft_budget(
    kept: Sequence[Candidate], cfg: DecodingConfig
) -> tuple[list[Candidate], list[Candidate]]:
    """`kept` with at most `cfg.max_drafts` evidence branches per hypothesis, chosen in
    `draft_order` (no-retrieval branches are not counted), and the ones left out, in that
    order."""
    evidence = draft_order([c for c in kept if c.rel is not None], cfg.draft_order_margin)
    allowed = {id(c) for c in first_of_each_hypothesis(evidence, cfg.max_drafts)}
    out = [c for c in kept if c.rel is None or id(c) in allowed]
    return out, [c for c in evidence if id(c) not in allowed]


def admitted(
    candidates: Sequence[Candidate], cfg: DecodingConfig, work: StepWork
) -> tuple[list[Candidate], list[Candidate]]:
    """The `candidates` that draft: none of `pruned_by_relevance`, not `certainly_filtered`,
    and within the draft budget; and those the budget alone left out, in draft order. `work`
    counts the pruned and the filtered ones."""
    best: dict[int, float] = {}
    for c in candidates:
        if c.rel is not None:
            best[c.parent] = max(best.get(c.parent, 0.0), candidate_relevance(c))
    kept: list[Candidate] = []
    for c in candidates:
        if pruned_by_relevance(c, best, cfg):
            work.pruned += 1
        elif certainly_filtered(c, cfg):
            work.filtered += 1
        else:
            kept.append(c)
    return within_draft_budget(kept, cfg)


def failing_hypotheses(
    candidates: Sequence[Candidate], drafted: Sequence[Drafted], cfg: DecodingConfig
) -> set[int]:
    """The hypotheses (parents) with evidence among a step's `candidates` none of whose
    `drafted` evidence branches passes the hard filters (a branch that drafted nothing is not
    among `drafted`), or, with `cfg.retry_flagged`, passes them without a flag a reader would
    be asked to check (`segment_flags`: low support, or numbers or names its passage lacks).
    A later segment that ranking would drop (`drops_later_segment`) fails too."""
    parents = {c.parent for c in candidates if c.branch.passage is not None}
    passing = set()
    for d in drafted:
        flags = segment_flags(d, answer_retrieved=True)
        if (
            d.grounded
            and passes_filters(d, cfg)
            and not (cfg.retry_flagged and flags)
            and not (d.later and drops_later_segment(flags, d.novelty, cfg))
        ):
            passing.add(d.parent)
    return parents - passing


def failed_relevance(drafted: Sequence[Drafted], parents: set[int]) -> dict[int, float]:
    """The highest s_rel among the drafted evidence branches of each of `parents` (0 for one
    with none): a passage read no more relevant than one that failed is not drafted after it."""
    bar = dict.fromkeys(parents, 0.0)
    for d in drafted:
        if d.parent in bar and d.rel is not None:
            bar[d.parent] = max(bar[d.parent], relevance_score(d.rel))
    return bar


def next_drafts(
    waiting: Sequence[Candidate], bar: dict[int, float]
) -> tuple[list[Candidate], list[Candidate], int]:
    """For each hypothesis of `bar` (`failed_relevance`), the first `waiting` branch whose s_rel
    is above its bar; the `waiting` branches left after them; and how many were dropped, the
    waiting branches of those hypotheses at or under the bar."""
    dropped = {
        id(c) for c in waiting if c.parent in bar and candidate_relevance(c) <= bar[c.parent]
    }
    eligible = [c for c in waiting if id(c) not in dropped]
    taken = {id(c) for c in first_of_each_hypothesis([c for c in eligible if c.parent in bar], 1)}
    return (
        [c for c in eligible if id(c) in taken],
        [c for c in eligible if id(c) not in taken],
        len(dropped),
    )


def expand(
    critic: Critic,
    candidates: Sequence[Candidate],
    cfg: DecodingConfig,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> StepWork:
    """Relevance, pruning, drafting, support and utility for every candidate of a step; then,
    while a hypothesis's drafts all fail (`failing_hypotheses`), its next passage in draft
    order (at most `retry_drafts` more)."""
    work = StepWork()
    evidence = [c for c in candidates if c.branch.passage is not None]
    with timed(work.timings_ms, "relevance", clock):
        unread = read_relevance(critic, evidence, cfg, work)
    skipped = {id(c) for c in unread}
    kept, waiting = admitted([c for c in candidates if id(c) not in skipped], cfg, work)
    waiting += unread
    drafted = draft_and_critique(critic, kept, cfg, work, clock)
    # A waiting branch passed the relevance filters and only the budget left it out, or it was
    # left unread where no relevance filter is on: either way it may draft.
    for _ in range(cfg.retry_drafts):
        failing = failing_hypotheses(candidates, drafted, cfg)
        with timed(work.timings_ms, "relevance", clock):
            read_each(critic, [c for c in waiting if c.parent in failing and c.rel is None], work)
        retried, waiting, dropped = next_drafts(waiting, failed_relevance(drafted, failing))
        work.pruned += dropped
        if not retried:
            break
        drafted += draft_and_critique(critic, retried, cfg, work, clock)
    work.pruned += len(waiting)
    work.drafted = drafted
    return work


def draft_and_critique(
    critic: Critic,
    kept: Sequence[Candidate],
    cfg: DecodingConfig,
    work: StepWork,
    clock: Callable[[], float],
) -> list[Drafted]:
    """Draft the `kept` branches that have no draft yet, then read the support (evidence
    branches) and utility of those that drafted something: what ranking sees of them."""
    with timed(work.timings_ms, "draft", clock):
        todo = [c for c in kept if c.draft is None]
        drafts = draft_past_echoes(critic, [c.branch for c in todo], cfg.max_segment_tokens, work)
        for c, d in zip(todo, drafts, strict=True):
            c.draft = d
        for c in kept:
            work.decode_tokens += len(c.draft.tokens) if c.draft is not None else 0
    kept = [c for c in kept if drafted_something(c.draft)]

    with timed(work.timings_ms, "critique", clock):
        grounded = [c for c in kept if c.branch.passage is not None]
        sups = critic.support([c.branch for c in grounded], [c.draft for c in grounded])  # type: ignore[misc]
        for c, sup in zip(grounded, sups, strict=True):
            c.sup = sup
            work.prefill_tokens += sup.prefill_tokens
        uses = critic.utility([c.branch for c in kept], [c.draft for c in kept])  # type: ignore[misc]
        for c, use in zip(kept, uses, strict=True):
            c.use = use
            work.prefill_tokens += use.prefill_tokens
    return [c.drafted() for c in kept]


def drafted_something(draft: Generation | None) -> bool:
    """Whether `draft` is a segment to critique: not blank, and not stuck in a loop (`loops`)."""
    return draft is not None and bool(draft.text.strip()) and not loops(draft.text)


@dataclass(frozen=True)
class EvidenceReads:
    """One evidence branch read as a first step reads it, no filter applied."""

    rel: LabelProbs
    draft: Generation
    sup: LabelProbs | None
    """None when the draft is no segment to critique (`drafted_something`)."""

    @property
    def s_rel(self) -> float:
        """`scoring.relevance_score` of the relevance read."""
        return relevance_score(self.rel.probs)

    @property
    def s_sup(self) -> float | None:
        """`scoring.support_score` of the support read; None without one."""
        return None if self.sup is None else support_score(self.sup.probs)


def read_evidence_branches(
    critic: Critic, branches: Sequence[Branch], max_tokens: int
) -> list[EvidenceReads]:
    """Relevance, a draft of `max_tokens` past any echo of the question, and support of each
    evidence branch, as the decoder's first step reads them, with no filter, budget or retry:
    what calibrating the support threshold and measuring the draft's choice read."""
    rels = critic.relevance(branches)
    drafts = draft_past_echoes(critic, branches, max_tokens, StepWork())
    kept = [i for i, d in enumerate(drafts) if drafted_something(d)]
    sups = dict(
        zip(
            kept,
            critic.support([branches[i] for i in kept], [drafts[i] for i in kept]),
            strict=True,
        )
    )
    return [
        EvidenceReads(rel, draft, sups.get(i))
        for i, (rel, draft) in enumerate(zip(rels, drafts, strict=True))
    ]


def draft_past_echoes(
    critic: Critic, branches: Sequence[Branch], max_tokens: int, work: StepWork
) -> list[Generation]:
    """Draft `branches`. A draft that only restates its question (`restates_question`) drafts
    once more, on past its echo: the echo stays in that draft's prompt and out of the answer.
    The prompt tokens of both, and the echo's tokens, count in `work`."""
    drafts = list(critic.draft(branches, max_tokens))
    work.prefill_tokens += sum(d.prefill_tokens for d in drafts)
    echoed = [
        i
        for i, (b, d) in enumerate(zip(branches, drafts, strict=True))
        if restates_question(d.text, b.question)
    ]
    if echoed:
        past = [replace(branches[i], prefix=branches[i].prefix + drafts[i].text) for i in echoed]
        for i, d in zip(echoed, critic.draft(past, max_tokens), strict=True):
            work.prefill_tokens += d.prefill_tokens
            work.decode_tokens += len(drafts[i].tokens)
            drafts[i] = d
    return drafts


class LocalBranchWorker:
    """`BranchWorker` on a `Critic` of this process (CLI, batch actors, the pool itself)."""

    def __init__(self, critic: Critic, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.critic = critic
        self.name = critic.name
        self._clock = clock

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        return self.critic.retrieval(branches)

    def expand(self, candidates: Sequence[Candidate], cfg: DecodingConfig) -> StepWork:
        return expand(self.critic, candidates, cfg, clock=self._clock)


def branch_worker(
    source: Critic | BranchWorker, *, clock: Callable[[], float] = time.perf_counter
) -> BranchWorker:
    """`source` itself when it does the branch work, else a `LocalBranchWorker` around it."""
    return source if isinstance(source, BranchWorker) else LocalBranchWorker(source, clock=clock)
