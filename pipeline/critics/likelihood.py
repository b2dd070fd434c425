"""Critique from the generator's own token log-probabilities (no extra model, no trained tokens).

Small instruct models answer yes/no critique questions almost independently of the passage, but
their likelihoods still carry the signal. Every raw signal is a mean per-token log-probability
(difference), mapped to a probability by a fitted logistic calibration, p = sigmoid(a·x + b):

* relevance: query-likelihood gain, mean over question tokens of
  log p(q | system, passage) − log p(q | system);
* support: segment-likelihood gain, mean over segment tokens of
  log p(y | x, passage) − log p(y | x), with the same prompt apart from the passage;
* retrieval need: the mean token log-probability of a first segment drafted without evidence
  (low confidence → retrieve). That closed-book draft comes with the decision (`LabelProbs.draft`)
  and is reused as the no-retrieval
  branch of the same step, so it is never generated twice;
* utility: the mean token log-probability of the drafted segment itself, calibrated on whether
  drafts contain the gold answer, i.e. p("this segment is a right answer").

The probabilities are laid out so the published formulas give back p exactly:
p_ret = p, s_rel = p, s_use = 2p − 1, and support uses the binomial split
(full, partial, none) = (p², 2p(1−p), (1−p)²), for which s_sup = p and the most likely label is
"full" when p > 2/3 and "none" when p < 1/3 — so `min_support` keeps its meaning.

Prompts put the passage first: "system + passage" is a prefix shared by the relevance request,
the draft and every later step of a branch, so the engine computes it once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from selfrag.pipeline.critics.base import RESERVED_PIECES, Branch, LabelProbs
from selfrag.pipeline.prompts import (
    ChatGlue,
    Part,
    PromptBuilder,
    Trusted,
    Untrusted,
    chat_glue,
    evidence_head,
)
from selfrag.pipeline.protocols import (
    ContinuationRequest,
    Generation,
    GenerationRequest,
    LanguageModel,
    Passage,
)
from selfrag.schemas.calibration import CalibrationSettings

DRAFT_TASK = "Answer the question in one or two sentences."
# Closed-book drafts of recent decisions (a repeated decision is not drafted again).
_CACHE_SIZE = 64


@dataclass(frozen=True)
class Signal:
    """A raw likelihood signal: its value (mean per token) and the prompt tokens it cost."""

    value: float
    prefill_tokens: int


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def support_probs(p: float) -> dict[str, float]:
    """(full, partial, none) = (p², 2p(1−p), (1−p)²): s_sup = p, label thresholds 1/3 and 2/3."""
    return {"full": p * p, "partial": 2.0 * p * (1.0 - p), "none": (1.0 - p) ** 2}


class LikelihoodCritic:
    """The `Critic` protocol from likelihood gains of the generating model itself."""

    name = "likelihood"

    def __init__(
        self,
        model: LanguageModel,
        calibration: CalibrationSettings | None = None,
        *,
        probe_tokens: int = 48,
    ) -> None:
        self._model = model
        self.calibration = calibration or CalibrationSettings()
        self._probe_tokens = probe_tokens
        self._glue: ChatGlue = chat_glue(model.chat_template)
        self._builder = PromptBuilder(model, reserved=RESERVED_PIECES)
        self._lock = threading.Lock()
        self._closed: OrderedDict[tuple[str, str], Generation] = OrderedDict()
        self._question_lp: OrderedDict[str, tuple[float, int]] = OrderedDict()

    # --- prompt layout ----------------------------------------------------------------------------

    def _head(self, passage: Passage | None) -> list[Part]:
        return [*evidence_head(self._glue, passage), Trusted("Question: ")]

    def _build(self, parts: list[Part], passage: Passage | None) -> tuple[list[int], int]:
        """Prompt tokens and the reusable prefix length (0 without a passage)."""
        if passage is None:
            return self._builder.build(parts), 0
        return self._builder.build_split(parts, len(evidence_head(self._glue, passage)))

    def _answer_split(
        self, question: str, prefix: str, passage: Passage | None
    ) -> tuple[list[int], int]:
        parts = [
            *self._head(passage),
            Untrusted(question),
            Trusted("\n\n" + DRAFT_TASK),
            Trusted(self._glue.assistant_start),
        ]
        if prefix:
            parts.append(Untrusted(prefix))
        return self._build(parts, passage)

    def _answer(self, question: str, prefix: str, passage: Passage | None) -> list[int]:
        return self._answer_split(question, prefix, passage)[0]

    def _question_tokens(self, question: str) -> list[int]:
        return self._builder.build([Untrusted(question)], bos=False)

    # --- raw signals (also used by `selfrag calibrate`) -----------------------------------------

    def relevance_signals(self, branches: Sequence[Branch]) -> list[Signal]:
        """Mean per-token log p(q | passage) − log p(q), all branches in one batched call."""
        if not branches:
            return []
        requests: list[ContinuationRequest] = []
        with self._lock:
            missing = list(
                dict.fromkeys(b.question for b in branches if b.question not in self._question_lp)
            )
        for q in missing:
            requests.append(
                ContinuationRequest(self._builder.build(self._head(None)), self._question_tokens(q))
            )
        for b in branches:
            prompt, reusable = self._build(self._head(b.passage), b.passage)
            requests.append(
                ContinuationRequest(prompt, self._question_tokens(b.question), reusable)
            )
        scores = self._model.continuation_logprobs(requests)
        base_cost = 0
        with self._lock:
            for q, s in zip(missing, scores[: len(missing)], strict=True):
                self._remember(self._question_lp, q, (sum(s.logprobs), len(s.logprobs)))
                base_cost += s.prefill_tokens
            baselines = {b.question: self._question_lp[b.question] for b in branches}
        out: list[Signal] = []
        for i, (b, s) in enumerate(zip(branches, scores[len(missing) :], strict=True)):
            total, n = baselines[b.question]
            gain = (sum(s.logprobs) - total) / max(n, 1)
            out.append(Signal(gain, s.prefill_tokens + (base_cost if i == 0 else 0)))
        return out

    def support_signals(
        self, branches: Sequence[Branch], drafts: Sequence[Generation]
    ) -> list[Signal]:
        """Mean per-token log p(y | x, d) − log p(y | x); log p(y | x, d) comes with the draft."""
        pairs = list(zip(branches, drafts, strict=True))
        scored = [(b, d) for b, d in pairs if d.tokens]
        requests = [
            ContinuationRequest(self._answer(b.question, b.prefix, None), list(d.tokens))
            for b, d in scored
        ]
        closed = iter(self._model.continuation_logprobs(requests) if requests else [])
        out: list[Signal] = []
        for _, d in pairs:
            if not d.tokens:
                out.append(Signal(0.0, 0))
                continue
            s = next(closed)
            gain = (sum(d.logprobs) - sum(s.logprobs)) / len(d.tokens)
            out.append(Signal(gain, s.prefill_tokens))
        return out

    def closed_book_drafts(self, branches: Sequence[Branch]) -> list[Generation]:
        """The first segment each branch's hypothesis would get without evidence (cached)."""
        keys = [(b.question, b.prefix) for b in branches]
        with self._lock:
            have = {k: self._closed[k] for k in keys if k in self._closed}
        todo = list(dict.fromkeys(k for k in keys if k not in have))
        if todo:
            requests = [
                GenerationRequest(self._answer(q, prefix, None), self._probe_tokens)
                for q, prefix in todo
            ]
            generated = self._model.generate(requests)
            with self._lock:
                for k, g in zip(todo, generated, strict=True):
                    self._remember(self._closed, k, g)
                    have[k] = g
        return [have[k] for k in keys]

    # --- the Critic protocol ----------------------------------------------------------------------

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        out = []
        for g in self.closed_book_drafts(branches):
            # An empty closed-book draft is no evidence of knowledge: treat it as least confident.
            x = mean(g.logprobs) if g.tokens else -20.0
            p = self.calibration.retrieval.probability(x)
            paid = Generation(g.tokens, g.text, g.logprobs, g.finish_reason, 0, g.stop_token)
            out.append(LabelProbs({"yes": p, "no": 1.0 - p}, g.prefill_tokens, paid))
        return out

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        out = []
        for s in self.relevance_signals(branches):
            p = self.calibration.relevance.probability(s.value)
            out.append(LabelProbs({"relevant": p, "irrelevant": 1.0 - p}, s.prefill_tokens))
        return out

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        # A no-retrieval branch of an adaptive step comes with its decision's closed-book
        # draft (`LabelProbs.draft`) and is not drafted again here.
        requests = []
        for b in branches:
            prompt, reusable = self._answer_split(b.question, b.prefix, b.passage)
            requests.append(
                GenerationRequest(
                    prompt,
                    max_tokens,
                    reusable_prefix=reusable,
                    sampling=b.sampling,
                    min_tokens=b.min_tokens,
                )
            )
        return self._model.generate(requests) if requests else []

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        return self.support_from_signals(self.support_signals(branches, drafts))

    def support_from_signals(self, signals: Sequence[Signal]) -> list[LabelProbs]:
        """The support probabilities of `support_signals`' segment-likelihood gains."""
        return [
            LabelProbs(
                support_probs(self.calibration.support.probability(s.value)), s.prefill_tokens
            )
            for s in signals
        ]

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        out = []
        for d in drafts:
            p = self.calibration.utility.probability(mean(d.logprobs)) if d.tokens else 0.0
            # s_use = Σ w_i·p_i with w_1 = −1, w_5 = +1 gives 2p − 1.
            out.append(LabelProbs({"5": p, "1": 1.0 - p}, 0))
        return out

    # --- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _remember(cache: OrderedDict, key: object, value: object) -> None:  # type: ignore[type-arg]
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
