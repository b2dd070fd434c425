"""Ranking a step's branches: critique-weighted scores, hard filters, and the segment beam."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from selfrag.pipeline.critics import RELEVANCE_LABELS, SUPPORT_LABELS, Branch, LabelProbs
from selfrag.pipeline.evidence import evidence_span
from selfrag.pipeline.grounding import missing_terms
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
    """A partial answer in the beam: its segments and cumulative score."""

    segments: tuple[SegmentOut, ...] = ()
    score: float = 0.0
    done: bool = False
    abstained: bool = False

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)


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

    def drafted(self) -> Drafted:
        """What ranking needs of this drafted branch."""
        assert self.draft is not None
        d, p = self.draft, self.branch.passage
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
            text=d.text,
            logprob=d.logprob,
            n_tokens=len(d.tokens),
            finished=d.finish_reason == "eos",
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
    rel: dict[str, float] | None
    sup: dict[str, float] | None
    use: dict[str, float] | None
    unsupported_terms: tuple[str, ...] = ()
    """Numbers and names of the segment that neither its passage nor the question holds."""
    similarity: float | None = None
    """The retriever's similarity of the branch's passage to the query (`Passage.similarity`)."""
    collection: str | None = None
    """The collection the branch's passage was indexed from (`protocols.COLLECTION`), if known."""

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
    c: Drafted, cfg: DecodingConfig, answer_retrieved: bool = False
) -> tuple[float, SegmentOut, bool]:
    """S for a drafted branch, the segment it would add to an answer that retrieved
    (`answer_retrieved`) or not, and whether it ends the answer."""
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
    segment = SegmentOut(
        text=c.text,
        citation=c.citation,
        retrieved=c.retrieved,
        p_ret=c.p_ret,
        s_rel=s_rel,
        s_sup=s_sup,
        s_use=s_use,
        is_sup=most_likely(c.sup, SUPPORT_LABELS) if c.sup is not None else None,
        unsupported_terms=list(c.unsupported_terms),
        flags=segment_flags(c, answer_retrieved),
        logprob=c.logprob,
        n_tokens=c.n_tokens,
        score=score,
    )
    return score, segment, c.finished


def ends_before(parent: Hypothesis, segment: SegmentOut) -> bool:
    """Whether the answer `parent` ends rather than go on with `segment`: a later segment that
    cites nothing in an answer that retrieved, or states numbers or names its passage lacks
    (unless `keep_unsupported_segments`). The first segment is never dropped; it is flagged."""
    if not parent.segments:
        return False
    return "uncited" in segment.flags or "unsupported_terms" in segment.flags


def rank_step(
    beam: Sequence[Hypothesis],
    live: Sequence[Hypothesis],
    drafted: Sequence[Drafted],
    cfg: DecodingConfig,
) -> StepRanking:
    """Score the drafted branches, drop those failing hard filters, keep the best `cfg.beam`.

    A live hypothesis whose branches all fail ends where it is (abstaining if it has no
    segment yet), unless `on_unsupported` lets its no-retrieval draft through.
    """
    filtered = 0
    pool: list[Hypothesis] = [h for h in beam if h.done]
    for index, parent in enumerate(live):
        available: list[tuple[float, SegmentOut, bool]] = []
        fallback: tuple[float, SegmentOut, bool] | None = None
        retrieved = any(seg.retrieved for seg in parent.segments)
        for c in (c for c in drafted if c.parent == index):
            scored = score_candidate(c, cfg, retrieved)
            if not c.grounded and c.retrieved:
                fallback = scored
            if passes_filters(c, cfg) and (
                cfg.keep_unsupported_segments or not ends_before(parent, scored[1])
            ):
                available.append(scored)
            else:
                filtered += 1
        if not available and fallback is not None and cfg.on_unsupported == "no_retrieval":
            available.append(fallback)
        if not available:
            pool.append(replace(parent, done=True, abstained=not parent.segments))
            continue
        for s, seg, finished in available:
            pool.append(
                Hypothesis(
                    segments=(*parent.segments, seg),
                    score=parent.score + s,
                    done=finished or len(parent.segments) + 1 >= cfg.max_segments,
                )
            )
    pool.sort(key=lambda h: h.score, reverse=True)
    return StepRanking(beam=pool[: cfg.beam], filtered=filtered)


def _page(value: str | None) -> int | None:
    """The PDF page a passage's metadata names (a positive number), else None."""
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None
