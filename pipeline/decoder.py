"""Self-RAG decoding: one segment at a time, a branch per passage, a segment-level beam."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from selfrag.pipeline.branching import BranchWorker, branch_worker, reusable_draft
from selfrag.pipeline.coverage import (
    QuestionPlan,
    about_topic,
    branch_question,
    plan_question,
    search_query,
    settle,
)
from selfrag.pipeline.critics import Branch, Critic
from selfrag.pipeline.critics.filters import unsettled_filters
from selfrag.pipeline.protocols import Generation, Passage, PassageSearch, Sampling
from selfrag.pipeline.ranking import (
    Candidate,
    Drafted,
    Hypothesis,
    StepRanking,
    SupportRead,
    best_support,
    rank_step,
)
from selfrag.pipeline.scoring import retrieval_probability, should_retrieve
from selfrag.pipeline.timings import add_timings, timed
from selfrag.schemas.answer import AnswerResponse, PassageOut, StopReason, Usage
from selfrag.schemas.decoding import DecodingConfig

Ranker = Callable[
    [Sequence[Hypothesis], Sequence[Hypothesis], Sequence[Drafted], DecodingConfig], StepRanking
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
    plan: QuestionPlan
    """What the question asks for (`coverage.plan_question`): which parts each step answers,
    when the answer is complete."""
    usage: Usage = field(default_factory=Usage)
    timings: dict[str, float] = field(default_factory=dict)
    passages: dict[str, Passage] = field(default_factory=dict)
    support: SupportRead | None = None
    """`best_support` of the first step: what decides abstention (`AnswerResponse.support`)."""
    static: list[Passage] | None = None
    """The first step's passages, which every later step chooses among when
    `segment_retrieval` is static."""

    def can_add(self, h: Hypothesis) -> bool:
        """Whether a step could add a segment to `h`: not when `max_retrievals` is spent and
        it retrieved, since a later segment citing nothing is dropped
        (`ranking.drops_later_segment`, unless `keep_unsupported_segments`)."""
        spent = self.usage.retrievals >= self.config.max_retrievals
        return not (spent and h.retrieved) or self.config.keep_unsupported_segments

    def budget_exceeded(self) -> StopReason | None:
        if self.clock() - self.started > self.config.timeout_s:
            return "timeout_s"
        if self.usage.prefill_tokens >= self.config.max_prefill_tokens:
            return "max_prefill_tokens"
        return None


def draft_sampling(config: DecodingConfig) -> Sampling | None:
    """How the drafts of `config` pick their tokens: None (greedy) at temperature 0."""
    if config.temperature == 0:
        return None
    return Sampling(config.temperature, config.top_p, config.seed)


def asked_question(question: str, config: DecodingConfig) -> str:
    """The question as branches are prompted with it: followed by the request's instructions
    (an OpenAI system message), which steer the drafts; retrieval searches `question` alone."""
    instructions = (config.instructions or "").strip()
    return f"{question}\n\n{instructions}" if instructions else question


class BeamDecoder:
    """Runs segment-level beam search over retrieval branches for one question at a time.

    Engines, retrievers and critique come in through protocols; this class is pure logic.
    Per step: the retrieval decision for the live hypotheses, one search per hypothesis that
    retrieves (for what its answer still misses: `pipeline.coverage`), the branch work of all
    branches (`BranchWorker.expand`), the ranker, then the stop rule (`coverage.settle`).
    """

    def __init__(
        self,
        critic_for: Callable[[str], Critic | BranchWorker],
        retriever: PassageSearch,
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
        """Answer `question` with a settled `config` (`runtime.answering.AnswerPath.config`:
        no filter left unset). `on_step` sees the leading hypothesis after every step."""
        unset = unsettled_filters(config)
        if unset:
            raise ValueError(
                f"config.{unset[0]} is unset: the decoder takes a settled config "
                "(AnswerPath.config, pipeline.critics.filters.settle_filters)"
            )
        worker = branch_worker(self._critic_for(config.critique), clock=self._clock)
        run = _Run(config, self._clock, self._clock(), plan_question(question))
        breadth = config.segments_per_step if run.plan.open_ended else 1
        beam: list[Hypothesis] = [Hypothesis(step_segments=breadth)]
        # Each step adds a segment (at most max_segments) or moves its answer on to the next
        # part or miss (`coverage.settle` ends it): this bound is never what stops it.
        for _ in range(2 * config.max_segments + len(run.plan.parts) + 1):
            beam = [h if h.done or run.can_add(h) else replace(h, done=True) for h in beam]
            live = [h for h in beam if not h.done]
            if not live:
                break
            stopped_by = run.budget_exceeded()
            if stopped_by is not None:
                run.usage.stopped_by = stopped_by
                break
            run.usage.steps += 1
            beam = self._step(beam, live, worker, run)
            if on_step is not None and beam:
                on_step(beam[0])
        best = max(beam, key=lambda h: h.score) if beam else Hypothesis()
        run.timings["total"] = (self._clock() - run.started) * 1e3
        return self._response(question, best, worker.name, run)

    # --- one step -------------------------------------------------------------------------------

    def _step(
        self,
        beam: list[Hypothesis],
        live: list[Hypothesis],
        worker: BranchWorker,
        run: _Run,
    ) -> list[Hypothesis]:
        cfg = step_config(run.config, live)
        candidates = self._open_branches(live, worker, run, cfg)
        work = worker.expand(candidates, cfg)
        run.usage.prefill_tokens += work.prefill_tokens
        run.usage.decode_tokens += work.decode_tokens
        run.usage.branches_pruned += work.pruned
        run.usage.branches_filtered += work.filtered
        add_timings(run.timings, work.timings_ms)

        if run.usage.steps == 1:  # only the first step's hypothesis has no segment to keep
            run.support = best_support(work.drafted, cfg)
        with timed(run.timings, "rank", run.clock):
            ranking = self._ranker(beam, live, work.drafted, cfg)
        run.usage.branches_filtered += ranking.filtered
        return [settle(run.plan, h) for h in ranking.beam]

    def _open_branches(
        self, live: list[Hypothesis], worker: BranchWorker, run: _Run, cfg: DecodingConfig
    ) -> list[Candidate]:
        asked = [asked_question(branch_question(run.plan, h), cfg) for h in live]
        p_rets: list[float | None] = [None] * len(live)
        closed: list[Generation | None] = [None] * len(live)
        if cfg.mode == "adaptive":
            asking = [asking_prefix(h, run.plan) for h in live]
            with timed(run.timings, "retrieval_decision", run.clock):
                decisions = worker.retrieval(
                    [Branch(q, a, None) for q, a in zip(asked, asking, strict=True)]
                )
            for i, d in enumerate(decisions):
                p_rets[i] = retrieval_probability(d.probs)
                # The closed-book draft the decision was read from is this hypothesis's
                # no-retrieval draft: never generated twice (a greedy one: a sampled
                # answer draws its own).
                if cfg.temperature == 0:
                    closed[i] = reusable_draft(d.draft, cfg.max_segment_tokens)
                run.usage.prefill_tokens += d.prefill_tokens

        retrieving: list[int] = []
        for index, p_ret in enumerate(p_rets):
            wants = cfg.mode == "always" or (
                cfg.mode == "adaptive"
                and p_ret is not None
                and should_retrieve(p_ret, cfg.threshold)
            )
            if wants and run.usage.retrievals + len(retrieving) < cfg.max_retrievals:
                retrieving.append(index)
        found: dict[int, list[Passage]] = {}
        if retrieving:
            with timed(run.timings, "retrieve", run.clock):
                found = dict(zip(retrieving, self._search(live, retrieving, run), strict=True))
            for passages in found.values():
                for p in passages:
                    run.passages.setdefault(p.id, p)

        sampling = draft_sampling(cfg)
        candidates: list[Candidate] = []
        for index, (h, p_ret) in enumerate(zip(live, p_rets, strict=True)):
            retrieve = index in found
            passages = found.get(index, [])
            run.usage.evidence_branches += len(passages)
            # A part of the question is answered on its own (a model told to answer in a
            # sentence or two ends its turn after an answer so far); a segment cut
            # mid-sentence, or an account of a topic, goes on from the answer so far.
            prefix = h.text if h.cut or not run.plan.parts else ""
            # After the answer so far a small model ends its turn, though the new passage
            # holds more of the account: its draft must say something.
            goes_on = 1 if run.plan.open_ended and prefix else 0
            for p in passages:
                branch = Branch(asked[index], prefix, p, sampling, min_tokens=goes_on)
                candidates.append(Candidate(index, branch, True, p_ret, said=h.text))
            branch = Branch(asked[index], prefix, None, sampling)
            draft = closed[index] if prefix == asking_prefix(h, run.plan) else None
            candidates.append(Candidate(index, branch, retrieve, p_ret, draft=draft, said=h.text))
        run.usage.branches_opened += len(candidates)
        return candidates

    def _search(
        self, live: list[Hypothesis], retrieving: list[int], run: _Run
    ) -> list[list[Passage]]:
        """The passages of each retrieving hypothesis: the search for what it still misses
        (`coverage.search_query`), past the passages its steps drafted on when
        `diverse_passages` (they rank last); with `segment_retrieval` static, the first
        step's search, shared by every later step. Past its first segment an account of a
        topic draws only on passages about it (`coverage.about_topic`)."""
        cfg = run.config
        hyps = [live[i] for i in retrieving]
        cited = [set(h.drafted_from) if cfg.diverse_passages else set() for h in hyps]
        static = cfg.segment_retrieval == "static" and run.plan.long
        if static and run.static is not None:
            results = [run.static] * len(hyps)
        else:
            extra = max(len(used) for used in cited)
            queries = [search_query(run.plan, h, cfg) for h in hyps]
            results = self._retriever.search_many(queries, cfg.top_k + extra)
            run.usage.retrievals += len(retrieving)
            if static:
                run.static = results[0]
        plan = run.plan
        return [
            _ranked_down([p for p in r if not h.segments or about_topic(plan, p)], used, cfg.top_k)
            for r, used, h in zip(results, cited, hyps, strict=True)
        ]

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
            support=run.support.score if run.support is not None else None,
            support_threshold=run.support.threshold if run.support is not None else None,
            segments=list(best.segments),
            passages=[PassageOut.model_validate(p.shown()) for p in order],
            usage=run.usage,
            timings_ms={k: round(v, 2) for k, v in run.timings.items()},
            model_id=self._model_id,
            critique=critique,
            config=run.config,
        )


def step_config(config: DecodingConfig, live: Sequence[Hypothesis]) -> DecodingConfig:
    """`config` as one step of the `live` hypotheses uses it: drafts no longer than the
    answer's budget has room for, and at least as many drafted passages as a step may keep
    segments (`Hypothesis.step_segments`)."""
    update: dict[str, int] = {}
    room = min(config.answer_budget - h.tokens for h in live)
    if room < config.max_segment_tokens:
        update["max_segment_tokens"] = max(room, 1)
    breadth = max(h.step_segments for h in live)
    if breadth > config.max_drafts:
        update["max_drafts"] = breadth
    return config.model_copy(update=update) if update else config


def asking_prefix(h: Hypothesis, plan: QuestionPlan) -> str:
    """The answer so far a step's retrieval decision reads after: in a long answer none (each
    step decides for the need it answers, a part or the topic: a new part is a new need for
    evidence), but past a segment cut mid-sentence, which goes on."""
    return h.text if h.cut or not plan.long else ""


def _ranked_down(passages: list[Passage], used: set[str], k: int) -> list[Passage]:
    """The first `k` of `passages`, those in `used` after all the others."""
    return ([p for p in passages if p.id not in used] + [p for p in passages if p.id in used])[:k]
