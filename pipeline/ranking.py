"""Ranking a step's branches: critique-weighted scores, hard filters, and the segment beam."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from selfrag.pipeline.critics import RELEVANCE_LABELS, SUPPORT_LABELS, Branch, LabelProbs
from selfrag.pipeline.evidence import evidence_span
from selfrag.pipeline.grounding import content_words, missing_terms, new_words, novelty
from selfrag.pipeline.prompts import passage_text
from selfrag.pipeline.protocols import COLLECTION, Generation
from selfrag.pipeline.scoring import (
    CritiqueWeights,
    evidence_support,
    most_likely,
    relevance_score,
    segment_score,
    support_rank,
    support_score,
    utility_score,
)
from selfrag.schemas.answer import Citation, SegmentFlag, SegmentOut
from selfrag.schemas.decoding import DecodingConfig


@dataclass(frozen=True)
class Hypothesis:
    """A partial answer in the beam: its segments and cumulative score, and where it stands
    in covering the question (`pipeline.coverage`, whose stop rule sets `done`)."""

    segments: tuple[SegmentOut, ...] = ()
    score: float = 0.0
    done: bool = False
    abstained: bool = False
    part: int = 0
    """The listed part of the question its next step answers (`coverage.QuestionPlan.parts`):
    a step moves on to the next part when it adds a whole segment, or adds none."""
    misses: int = 0
    """Steps in a row that added no segment (every branch failed the hard filters)."""
    cut: bool = False
    """Its last segment was cut by `max_segment_tokens` before its sentence ended."""
    drafted_from: frozenset[str] = frozenset()
    """The passages its steps have drafted on, whether their segments were kept or not: a
    later search ranks them last (`DecodingConfig.diverse_passages`)."""
    step_segments: int = 1
    """Segments a step may add to it: `DecodingConfig.segments_per_step` in an open account
    (`coverage.QuestionPlan.open_ended`), else 1."""

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    @property
    def retrieved(self) -> bool:
        """Whether a step of it retrieved: a later segment then cites or is dropped
        (`drops_later_segment`)."""
        return any(s.retrieved for s in self.segments)

    @property
    def tokens(self) -> int:
        """The tokens its segments hold, which `DecodingConfig.answer_budget` bounds."""
        return sum(s.n_tokens for s in self.segments)


@dataclass
class Candidate:
    """A branch of the live hypothesis at index `parent` of a step, as the branch work fills
    it in (`pipeline.branching`): relevance, its draft, support and utility."""

    parent: int
    branch: Branch
    retrieved: bool
    p_ret: float | None
    rel: LabelProbs | None = None
    draft: Generation | None = None
    sup: LabelProbs | None = None
    use: LabelProbs | None = None
    said: str = ""
    """The answer so far of its hypothesis, which a branch answering a part of the question
    on its own does not draft after (`Branch.prefix` is empty then)."""

    def drafted(self) -> Drafted:
        """What ranking needs of this drafted branch: a draft made on its own after an answer
        so far is set apart from it by a space."""
        assert self.draft is not None
        d, p = self.draft, self.branch.passage
        said = f"{self.branch.question} {self.said or self.branch.prefix}"
        text = d.text
        if self.said and not self.branch.prefix and text[:1] not in ("", " ", "\n"):
            text = f" {text}"
        return Drafted(
            parent=self.parent,
            retrieved=self.retrieved,
            p_ret=self.p_ret,
            citation=Citation(
                passage_id=p.id,
                title=p.title,
                url=p.metadata.get("url"),
                page=_page(p.metadata.get("page")),
                evidence=evidence_span(p.text, d.text),
            )
            if p is not None
            else None,
            text=text,
            logprob=d.logprob,
            n_tokens=len(d.tokens),
            finished=d.finish_reason == "eos",
            cut=d.finish_reason == "length",
            novelty=novelty(d.text, said),
            new_words=new_words(d.text, said),
            later=bool((self.said or self.branch.prefix).strip()),
            rel=self.rel.probs if self.rel is not None else None,
            sup=self.sup.probs if self.sup is not None else None,
            use=self.use.probs if self.use is not None else None,
            similarity=p.similarity if p is not None else None,
            collection=p.metadata.get(COLLECTION) if p is not None else None,
            unsupported_terms=tuple(missing_terms(d.text, passage_text(p)))
            if p is not None
            else (),
        )


@dataclass(frozen=True)
class Drafted:
    """A drafted branch as the ranker sees it: scores and the segment's text, no token lists
    and no passage text."""

    parent: int
    retrieved: bool
    p_ret: float | None
    citation: Citation | None
    text: str
    logprob: float
    n_tokens: int
    finished: bool
    """The draft ended with the model's end of generation."""
    rel: dict[str, float] | None
    sup: dict[str, float] | None
    use: dict[str, float] | None
    unsupported_terms: tuple[str, ...] = ()
    """Numbers and names of the segment that neither its passage nor the question holds."""
    similarity: float | None = None
    """The retriever's similarity of the branch's passage to the query (`Passage.similarity`)."""
    collection: str | None = None
    """The collection the branch's passage was indexed from (`protocols.COLLECTION`), if known."""
    cut: bool = False
    """The draft stopped at `max_segment_tokens` before its sentence ended."""
    novelty: float | None = None
    """The share of the segment's content words that neither the question nor the answer so
    far holds (`grounding.novelty`); None when it has no content word."""
    new_words: frozenset[str] = frozenset()
    """Those content words (`grounding.new_words`): what a segment kept before it in the same
    step may already say (`Hypothesis.step_segments`)."""
    later: bool = False
    """The segment would follow an answer so far (not the answer's first)."""

    @property
    def evidence_support(self) -> float | None:
        """s_sup weighed by the passage's similarity (`scoring.evidence_support`): what
        `min_support_score` is compared with; None when the branch has no support read."""
        if self.sup is None:
            return None
        return evidence_support(support_score(self.sup), self.similarity)

    @property
    def grounded(self) -> bool:
        return self.citation is not None


@dataclass(frozen=True)
class StepRanking:
    beam: list[Hypothesis]
    filtered: int


def passes_filters(c: Drafted, cfg: DecodingConfig) -> bool:
    """Hard filters apply to every branch of a retrieval step; a branch without evidence
    cannot meet an evidence requirement."""
    if not c.retrieved:
        return True
    if cfg.require_relevant and (
        c.rel is None or most_likely(c.rel, RELEVANCE_LABELS) != "relevant"
    ):
        return False
    if threshold := cfg.support_threshold(c.collection):
        score = c.evidence_support
        if score is None or score < threshold:
            return False
    if cfg.min_support not in (None, "none"):
        if c.sup is None:
            return False
        label = most_likely(c.sup, SUPPORT_LABELS)
        if support_rank(label) < support_rank(cfg.min_support):
            return False
    return True


@dataclass(frozen=True)
class SupportRead:
    """A branch's `Drafted.evidence_support` and the threshold its passage is held to
    (`DecodingConfig.support_threshold`; 0 with the filter off)."""

    score: float
    threshold: float

    @property
    def margin(self) -> float:
        return self.score - self.threshold


def best_support(drafted: Sequence[Drafted], cfg: DecodingConfig) -> SupportRead | None:
    """The support of the grounded `drafted` branch that passes every hard filter but the
    support threshold with the most support above its threshold. With that filter on (and
    `on_unsupported` abstain), a hypothesis without segments whose step retrieved abstains
    exactly when this is None or below its threshold."""
    others = cfg.model_copy(update={"min_support_score": 0.0, "min_support_score_by_corpus": {}})
    reads = [
        SupportRead(score, cfg.support_threshold(c.collection))
        for c in drafted
        if c.grounded and (score := c.evidence_support) is not None and passes_filters(c, others)
    ]
    return max(reads, key=lambda r: r.margin, default=None)


def needs_evidence(cfg: DecodingConfig) -> bool:
    """Whether a hard filter asks for relevance or support, which a branch without a passage
    cannot show."""
    return (
        cfg.require_relevant
        or bool(cfg.min_support_score)
        or any((cfg.min_support_score_by_corpus or {}).values())
        or cfg.min_support not in (None, "none")
    )


def certainly_filtered(c: Candidate, cfg: DecodingConfig) -> bool:
    """Whether the hard filters reject `c` whatever it would draft, so it need not draft: the
    no-evidence branch of a retrieval step under an evidence requirement (unless
    `on_unsupported` keeps it as the fallback), or a passage judged irrelevant under
    `require_relevant`."""
    if not c.retrieved:
        return False
    if c.branch.passage is None:
        return needs_evidence(cfg) and cfg.on_unsupported == "abstain"
    return (
        cfg.require_relevant
        and c.rel is not None
        and most_likely(c.rel.probs, RELEVANCE_LABELS) != "relevant"
    )


def segment_flags(c: Drafted, answer_retrieved: bool) -> list[SegmentFlag]:
    """What a reader should check in the segment `c` would add to an answer that retrieved
    (`answer_retrieved`: this step or an earlier one) or not (`SegmentOut.flags`)."""
    flags: list[SegmentFlag] = []
    if not c.grounded and (c.retrieved or answer_retrieved):
        flags.append("uncited")
    if c.unsupported_terms:
        flags.append("unsupported_terms")
    if c.grounded and c.sup is not None and most_likely(c.sup, SUPPORT_LABELS) != "full":
        flags.append("low_support")
    return flags


def score_candidate(
    c: Drafted, cfg: DecodingConfig, parent: Hypothesis | None = None
) -> tuple[float, SegmentOut]:
    """S for a drafted branch, and the segment it would add to `parent` (None: an answer
    with no segment yet, that did not retrieve). A segment after the first also scores what
    it adds (`w_new` times its novelty): one that restates the answer so far ranks below one
    that states something new."""
    answer_retrieved = parent is not None and parent.retrieved
    later = parent is not None and bool(parent.segments)
    s_rel = relevance_score(c.rel) if c.rel is not None else None
    s_sup = support_score(c.sup) if c.sup is not None else None
    s_use = utility_score(c.use) if c.use is not None else None
    score = segment_score(
        c.logprob,
        s_rel=s_rel,
        s_sup=s_sup,
        s_use=s_use,
        weights=CritiqueWeights(cfg.w_rel, cfg.w_sup, cfg.w_use),
        n_tokens=c.n_tokens,
        length_normalize=cfg.length_normalize,
    )
    if later:
        score += cfg.w_new * (c.novelty or 0.0)
    segment = SegmentOut(
        text=c.text,
        citation=c.citation,
        retrieved=c.retrieved,
        p_ret=c.p_ret,
        s_rel=s_rel,
        s_sup=s_sup,
        s_use=s_use,
        novelty=c.novelty,
        is_sup=most_likely(c.sup, SUPPORT_LABELS) if c.sup is not None else None,
        unsupported_terms=list(c.unsupported_terms),
        flags=segment_flags(c, answer_retrieved),
        logprob=c.logprob,
        n_tokens=c.n_tokens,
        score=score,
    )
    return score, segment


def dropped_after(parent: Hypothesis, segment: SegmentOut, cfg: DecodingConfig) -> bool:
    """Whether `segment` is unavailable to the answer `parent` though it passes the hard
    filters (`drops_later_segment`). The first segment is never dropped so; it is flagged."""
    return bool(parent.segments) and drops_later_segment(segment.flags, segment.novelty, cfg)


def drops_later_segment(flags: Sequence[str], novelty: float | None, cfg: DecodingConfig) -> bool:
    """Whether a segment after an answer's first, with these `flags` (`segment_flags`) and
    `novelty`, is dropped: it cites nothing in an answer that retrieved, or states numbers or
    names its passage lacks (unless `keep_unsupported_segments`), or says too little that is
    new (novelty under `min_novelty`). The answer goes on without it."""
    unsupported = "uncited" in flags or "unsupported_terms" in flags
    if unsupported and not cfg.keep_unsupported_segments:
        return True
    return (novelty or 0.0) < cfg.min_novelty


def rank_step(
    beam: Sequence[Hypothesis],
    live: Sequence[Hypothesis],
    drafted: Sequence[Drafted],
    cfg: DecodingConfig,
) -> StepRanking:
    """Score the drafted branches, drop those failing hard filters (or `dropped_after`, or
    past the answer's token budget), keep the best `cfg.beam`. Each available draft extends
    its hypothesis by its segment, and, in a step of an open account, by the other drafts'
    that add something (`more_segments`); `done` at `max_segments` or the budget.

    A live hypothesis whose branches all fail stays as it is, with one more miss, unless
    `on_unsupported` lets its no-retrieval draft through: whether it goes on is the stop
    rule's call (`pipeline.coverage`), which sets `done` on every hypothesis that is not at
    `max_segments`.
    """
    filtered = 0
    pool: list[Hypothesis] = [h for h in beam if h.done]
    for index, parent in enumerate(live):
        available: list[Scored] = []
        fallback: Scored | None = None
        for c in (c for c in drafted if c.parent == index):
            score, segment = score_candidate(c, cfg, parent)
            if not c.grounded and c.retrieved:
                fallback = (score, segment, c)
            fits = parent.tokens + c.n_tokens <= cfg.answer_budget
            if fits and passes_filters(c, cfg) and not dropped_after(parent, segment, cfg):
                available.append((score, segment, c))
            else:
                filtered += 1
        if not available and fallback is not None and cfg.on_unsupported == "no_retrieval":
            available.append(fallback)
        tried = parent.drafted_from | {
            c.citation.passage_id for c in drafted if c.parent == index and c.citation is not None
        }
        if not available:
            pool.append(
                replace(
                    parent,
                    part=parent.part + 1,
                    misses=parent.misses + 1,
                    cut=False,
                    drafted_from=tried,
                )
            )
            continue
        available.sort(key=lambda a: a[0], reverse=True)
        for first in available:
            kept = [first, *more_segments(parent, first, available, cfg)]
            segments = (*parent.segments, *(segment for _, segment, _ in kept))
            last = kept[-1][2]
            h = Hypothesis(
                segments=segments,
                score=parent.score + sum(score for score, _, _ in kept),
                part=parent.part + (0 if last.cut else 1),
                cut=last.cut,
                drafted_from=tried,
                step_segments=parent.step_segments,
            )
            full = len(segments) >= cfg.max_segments or h.tokens >= cfg.answer_budget
            pool.append(replace(h, done=full))
    pool.sort(key=lambda h: h.score, reverse=True)
    return StepRanking(beam=pool[: cfg.beam], filtered=filtered)


Scored = tuple[float, SegmentOut, Drafted]


def more_segments(
    parent: Hypothesis, first: Scored, available: Sequence[Scored], cfg: DecodingConfig
) -> list[Scored]:
    """What a step adds to `parent` after its segment `first`, up to `parent.step_segments`
    in all: the other `available` drafts (best first) of passages not cited yet in this step,
    each finished, within the answer's budget and the segment count, and saying something
    that neither the question, the answer so far nor the segments kept before it say
    (`min_novelty`). None after a segment cut mid-sentence, which the next step goes on."""
    if parent.step_segments < 2 or first[2].cut:
        return []
    kept: list[Scored] = []
    cited = {first[2].citation.passage_id} if first[2].citation is not None else set()
    said = content_words(first[1].text)
    tokens = parent.tokens + first[2].n_tokens
    room = min(parent.step_segments, cfg.max_segments - len(parent.segments)) - 1
    for score, segment, c in available:
        if len(kept) >= room:
            break
        if c.citation is None or c.citation.passage_id in cited or c.cut:
            continue
        if tokens + c.n_tokens > cfg.answer_budget:
            continue
        share = len(c.new_words - said) / len(c.new_words) if c.new_words else 0.0
        fresh = (c.novelty or 0.0) * share
        if fresh < cfg.min_novelty:
            continue
        # Drafted side by side, not one after another: a draft that starts a sentence without
        # a space would run into the segment before it.
        text = segment.text if segment.text[:1].isspace() else f" {segment.text}"
        kept.append((score, segment.model_copy(update={"novelty": fresh, "text": text}), c))
        cited.add(c.citation.passage_id)
        said |= content_words(segment.text)
        tokens += c.n_tokens
    return kept


def _page(value: str | None) -> int | None:
    """The PDF page a passage's metadata names (a positive number), else None."""
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None
