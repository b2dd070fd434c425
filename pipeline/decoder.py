"""Self-RAG decoding: one segment at a time, a branch per passage, a segment-level beam."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pipeline.critique import (
    RELEVANCE_LABELS,
    SUPPORT_LABELS,
    Branch,
    Critic,
    LabelProbs,
)
from pipeline.protocols import Generation, Passage, Retriever
from pipeline.scoring import (
    CritiqueWeights,
    most_likely,
    relevance_score,
    retrieval_probability,
    segment_score,
    should_retrieve,
    support_rank,
    support_score,
    utility_score,
)
from schemas.answer import AnswerResponse, Citation, PassageOut, SegmentOut, Usage
from schemas.decoding import DecodingConfig

ABSTAIN_MESSAGE = "The retrieved evidence does not support an answer to this question."
NO_ANSWER_MESSAGE = "The model produced no answer to this question."


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
class _Candidate:
    parent: Hypothesis
    branch: Branch
    retrieved: bool
    p_ret: float | None
    rel: LabelProbs | None = None
    draft: Generation | None = None
    sup: LabelProbs | None = None
    use: LabelProbs | None = None


@dataclass
class _Run:
    """Mutable bookkeeping of one `answer` call."""

    config: DecodingConfig
    clock: Callable[[], float]
    started: float
    usage: Usage = field(default_factory=Usage)
    timings: dict[str, float] = field(default_factory=dict)
    passages: dict[str, Passage] = field(default_factory=dict)

    def timed(self, stage: str, start: float) -> None:
        self.timings[stage] = self.timings.get(stage, 0.0) + (self.clock() - start) * 1e3

    def budget_exceeded(self) -> str | None:
        if self.clock() - self.started > self.config.timeout_s:
            return "timeout_s"
        if self.usage.prefill_tokens >= self.config.max_prefill_tokens:
            return "max_prefill_tokens"
        return None


class SelfRAGDecoder:
    """Runs segment-level beam search over retrieval branches for one question at a time.

    Engines, retrievers and critique come in through protocols; this class is pure logic.
    """

    def __init__(
        self,
        critic_for: Callable[[str], Critic],
        retriever: Retriever,
        model_id: str,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._critic_for = critic_for
        self._retriever = retriever
        self._model_id = model_id
        self._clock = clock

    def answer(self, question: str, config: DecodingConfig) -> AnswerResponse:
        run = _Run(config=config, clock=self._clock, started=self._clock())
        critic = self._critic_for(config.critique)
        beam: list[Hypothesis] = [Hypothesis()]
        for _ in range(config.max_segments):
            live = [h for h in beam if not h.done]
            if not live:
                break
            stopped_by = run.budget_exceeded()
            if stopped_by is not None:
                run.usage.stopped_by = stopped_by
                break
            run.usage.steps += 1
            beam = self._step(question, beam, live, critic, run)
        best = max(beam, key=lambda h: h.score) if beam else Hypothesis()
        run.timings["total"] = (self._clock() - run.started) * 1e3
        return self._response(question, best, critic.name, run)

    # --- one step -------------------------------------------------------------------------------

    def _step(
        self,
        question: str,
        beam: list[Hypothesis],
        live: list[Hypothesis],
        critic: Critic,
        run: _Run,
    ) -> list[Hypothesis]:
        cfg = run.config
        candidates = self._open_branches(question, live, critic, run)

        evidence = [c for c in candidates if c.branch.passage is not None]
        t = run.clock()
        for c, rel in zip(evidence, critic.relevance([c.branch for c in evidence]), strict=True):
            c.rel = rel
            run.usage.prefill_tokens += rel.prefill_tokens
        run.timed("relevance", t)
        kept: list[_Candidate] = []
        for c in candidates:
            if c.rel is not None and relevance_score(c.rel.probs) < cfg.min_relevance:
                run.usage.branches_pruned += 1
            else:
                kept.append(c)

        t = run.clock()
        drafts = critic.draft([c.branch for c in kept], cfg.max_segment_tokens)
        for c, d in zip(kept, drafts, strict=True):
            c.draft = d
            run.usage.prefill_tokens += d.prefill_tokens
            run.usage.decode_tokens += len(d.tokens)
        run.timed("draft", t)
        kept = [c for c in kept if c.draft is not None and c.draft.text.strip()]

        t = run.clock()
        grounded = [c for c in kept if c.branch.passage is not None]
        sups = critic.support([c.branch for c in grounded], [c.draft for c in grounded])  # type: ignore[misc]
        for c, sup in zip(grounded, sups, strict=True):
            c.sup = sup
            run.usage.prefill_tokens += sup.prefill_tokens
        uses = critic.utility([c.branch for c in kept], [c.draft for c in kept])  # type: ignore[misc]
        for c, use in zip(kept, uses, strict=True):
            c.use = use
            run.usage.prefill_tokens += use.prefill_tokens
        run.timed("critique", t)

        return self._select(beam, live, candidates, kept, run)

    def _open_branches(
        self, question: str, live: list[Hypothesis], critic: Critic, run: _Run
    ) -> list[_Candidate]:
        cfg = run.config
        p_rets: list[float | None] = [None] * len(live)
        if cfg.mode == "adaptive":
            t = run.clock()
            decisions = critic.retrieval([Branch(question, h.text, None) for h in live])
            run.timed("retrieval_decision", t)
            for i, d in enumerate(decisions):
                p_rets[i] = retrieval_probability(d.probs)
                run.usage.prefill_tokens += d.prefill_tokens

        candidates: list[_Candidate] = []
        for h, p_ret in zip(live, p_rets, strict=True):
            wants = cfg.mode == "always" or (
                cfg.mode == "adaptive"
                and p_ret is not None
                and should_retrieve(p_ret, cfg.threshold)
            )
            retrieve = wants and run.usage.retrievals < cfg.max_retrievals
            passages: list[Passage] = []
            if retrieve:
                t = run.clock()
                query = " ".join(f"{question} {h.text}".split())
                passages = self._retriever.search(query, cfg.top_k)
                run.timed("retrieve", t)
                run.usage.retrievals += 1
                for p in passages:
                    run.passages.setdefault(p.id, p)
            for p in passages:
                candidates.append(_Candidate(h, Branch(question, h.text, p), True, p_ret))
            candidates.append(_Candidate(h, Branch(question, h.text, None), retrieve, p_ret))
        run.usage.branches_opened += len(candidates)
        return candidates

    def _select(
        self,
        beam: list[Hypothesis],
        live: list[Hypothesis],
        candidates: Sequence[_Candidate],
        kept: Sequence[_Candidate],
        run: _Run,
    ) -> list[Hypothesis]:
        cfg = run.config
        weights = CritiqueWeights(cfg.w_rel, cfg.w_sup, cfg.w_use)
        pool: list[Hypothesis] = [h for h in beam if h.done]
        for parent in live:
            own = [c for c in kept if c.parent is parent]
            available: list[tuple[float, SegmentOut, bool]] = []
            fallback: tuple[float, SegmentOut, bool] | None = None
            for c in own:
                scored = self._score(c, weights, cfg.length_normalize)
                if c.branch.passage is None and c.retrieved:
                    fallback = scored
                if self._passes_filters(c, run):
                    available.append(scored)
                else:
                    run.usage.branches_filtered += 1
            if not available and fallback is not None and cfg.on_unsupported == "no_retrieval":
                available.append(fallback)
            if not available:
                # Every branch failed: this hypothesis ends here (abstaining if it has nothing).
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
        return pool[: cfg.beam]

    @staticmethod
    def _passes_filters(c: _Candidate, run: _Run) -> bool:
        """Hard filters apply to every branch of a retrieval step; a branch without evidence
        cannot meet an evidence requirement."""
        cfg = run.config
        if not c.retrieved:
            return True
        if cfg.require_relevant:
            if c.rel is None or most_likely(c.rel.probs, RELEVANCE_LABELS) != "relevant":
                return False
        if cfg.min_support != "none":
            if c.sup is None:
                return False
            label = most_likely(c.sup.probs, SUPPORT_LABELS)
            if support_rank(label) < support_rank(cfg.min_support):
                return False
        return True

    @staticmethod
    def _score(
        c: _Candidate, weights: CritiqueWeights, length_normalize: bool
    ) -> tuple[float, SegmentOut, bool]:
        assert c.draft is not None
        d = c.draft
        s_rel = relevance_score(c.rel.probs) if c.rel is not None else None
        s_sup = support_score(c.sup.probs) if c.sup is not None else None
        s_use = utility_score(c.use.probs) if c.use is not None else None
        score = segment_score(
            d.logprob,
            s_rel=s_rel,
            s_sup=s_sup,
            s_use=s_use,
            weights=weights,
            n_tokens=len(d.tokens),
            length_normalize=length_normalize,
        )
        p = c.branch.passage
        segment = SegmentOut(
            text=d.text,
            citation=Citation(passage_id=p.id, title=p.title) if p is not None else None,
            retrieved=c.retrieved,
            p_ret=c.p_ret,
            s_rel=s_rel,
            s_sup=s_sup,
            s_use=s_use,
            is_sup=most_likely(c.sup.probs, SUPPORT_LABELS) if c.sup is not None else None,
            logprob=d.logprob,
            n_tokens=len(d.tokens),
            score=score,
        )
        return score, segment, d.finish_reason == "eos"

    def _response(
        self, question: str, best: Hypothesis, critique: str, run: _Run
    ) -> AnswerResponse:
        text = best.text.strip()
        abstained = best.abstained or not text
        if abstained:
            text = ABSTAIN_MESSAGE if best.abstained or run.usage.retrievals else NO_ANSWER_MESSAGE
        cited = {s.citation.passage_id for s in best.segments if s.citation is not None}
        order = sorted(run.passages.values(), key=lambda p: (p.id not in cited, -p.score))
        return AnswerResponse(
            question=question,
            answer=text,
            abstained=abstained,
            segments=list(best.segments),
            passages=[
                PassageOut(id=p.id, title=p.title, text=p.text, score=p.score) for p in order
            ],
            usage=run.usage,
            timings_ms={k: round(v, 2) for k, v in run.timings.items()},
            model_id=self._model_id,
            critique=critique,
            config=run.config,
        )
