"""Self-RAG decoding: one segment at a time, a branch per passage, a segment-level beam."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from selfrag.pipeline.critics import Branch, Critic, resolve_filters
from selfrag.pipeline.protocols import Passage, Retriever
from selfrag.pipeline.ranking import Candidate, Hypothesis, StepRanking, rank_step
from selfrag.pipeline.scoring import relevance_score, retrieval_probability, should_retrieve
from selfrag.schemas.answer import AnswerResponse, PassageOut, Usage
from selfrag.schemas.decoding import DecodingConfig

Ranker = Callable[
    [Sequence[Hypothesis], Sequence[Hypothesis], Sequence[Candidate], DecodingConfig], StepRanking
]
StepListener = Callable[[Hypothesis], None]

ABSTAIN_MESSAGE = "The retrieved evidence does not support an answer to this question."
NO_ANSWER_MESSAGE = "The model produced no answer to this question."


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
        *,
        ranker: Ranker = rank_step,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._critic_for = critic_for
        self._retriever = retriever
        self._model_id = model_id
        self._ranker = ranker
        self._clock = clock

    def answer(
        self, question: str, config: DecodingConfig, on_step: StepListener | None = None
    ) -> AnswerResponse:
        """Answer `question`. `on_step` sees the leading hypothesis after every step."""
        critic = self._critic_for(config.critique)
        config = resolve_filters(config, critic.name)
        run = _Run(config=config, clock=self._clock, started=self._clock())
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
            if on_step is not None and beam:
                on_step(beam[0])
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
        kept: list[Candidate] = []
        for c in candidates:
            if c.rel is not None and relevance_score(c.rel.probs) < (cfg.min_relevance or 0.0):
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

        t = run.clock()
        ranking = self._ranker(beam, live, kept, cfg)
        run.usage.branches_filtered += ranking.filtered
        run.timed("rank", t)
        return ranking.beam

    def _open_branches(
        self, question: str, live: list[Hypothesis], critic: Critic, run: _Run
    ) -> list[Candidate]:
        cfg = run.config
        p_rets: list[float | None] = [None] * len(live)
        if cfg.mode == "adaptive":
            t = run.clock()
            decisions = critic.retrieval([Branch(question, h.text, None) for h in live])
            run.timed("retrieval_decision", t)
            for i, d in enumerate(decisions):
                p_rets[i] = retrieval_probability(d.probs)
                run.usage.prefill_tokens += d.prefill_tokens

        candidates: list[Candidate] = []
        for index, (h, p_ret) in enumerate(zip(live, p_rets, strict=True)):
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
            run.usage.evidence_branches += len(passages)
            for p in passages:
                candidates.append(Candidate(index, Branch(question, h.text, p), True, p_ret))
            candidates.append(Candidate(index, Branch(question, h.text, None), retrieve, p_ret))
        run.usage.branches_opened += len(candidates)
        return candidates

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
