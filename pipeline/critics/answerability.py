"""The answerability critique: any source, with s_sup replaced by `pipeline.answerability_model`'s
p.

`read_support` is the one place the combiner's features are read, for the critique at answer
time and for fitting (`jobs.answerability_training`): the source's own support probabilities, the
blocks' output at the chat layout's support and relevance prompts (in the same engine request
as the learned heads' reads; one extra request each for other sources), and the draft's
log-probability without its passage (one continuation request per grounded branch).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from selfrag.pipeline.answerability_model import AnswerabilityModel, draft_features, probe_name
from selfrag.pipeline.critics.base import Branch, Critic, LabelProbs, read_requests
from selfrag.pipeline.critics.chat import ChatCritic, SequenceCritic
from selfrag.pipeline.critics.learned import LearnedCritic
from selfrag.pipeline.critics.likelihood import LikelihoodCritic, support_probs
from selfrag.pipeline.protocols import (
    ContinuationRequest,
    Generation,
    LanguageModel,
    TokenScores,
)
from selfrag.pipeline.scoring import relevance_score, support_score

_RELEVANCE_MEMO = 256


@dataclass(frozen=True)
class RelevanceReading:
    """The source's relevance probabilities of a branch and the blocks' output at the chat
    layout's relevance prompt."""

    probs: LabelProbs
    states: dict[int, tuple[float, ...]]


@dataclass(frozen=True)
class SupportReading:
    """What the combiner reads of one branch: the source's support, the named features and
    the blocks' output by probe feature name (all empty for a branch without passage or
    draft)."""

    support: LabelProbs
    values: dict[str, float]
    states: dict[str, tuple[float, ...]]
    prefill_tokens: int

    @property
    def grounded(self) -> bool:
        return bool(self.values)


def _split(model: LanguageModel, blocks: Sequence[int]) -> tuple[int | None, tuple[int, ...]]:
    """(the last block, the middle ones of `blocks`); the last block's output is the final
    hidden state, the others come through the engine's layer tap."""
    last = (model.n_layers - 1) if model.n_layers is not None else None
    middle = tuple(b for b in blocks if b != last)
    if middle and model.n_layers is None:
        raise ValueError("the answerability model reads middle layers, which this engine cannot")
    return last, middle


def read_relevance(
    inner: Critic, model: LanguageModel, branches: Sequence[Branch], blocks: Sequence[int]
) -> list[RelevanceReading]:
    """The source's relevance of each branch and the output of `blocks` at the relevance
    prompt (from the heads' own request for the learned source, else one more request)."""
    if not blocks:
        return [RelevanceReading(p, {}) for p in inner.relevance(branches)]
    last, middle = _split(model, blocks)
    chat = inner if isinstance(inner, ChatCritic) else SequenceCritic(model)
    prompts = [chat.relevance_prompt(b) for b in branches]
    if isinstance(inner, LearnedCritic):
        reads = inner.read_with_layers(
            "relevance", [p for p, _ in prompts], [n for _, n in prompts], middle
        )
        return [RelevanceReading(probs, block_states(r, blocks, last)) for probs, r in reads]
    requests = read_requests(
        [p for p, _ in prompts], [n for _, n in prompts], hidden=last in blocks, layers=middle
    )
    replies = model.next_token_logprobs(requests) if requests else []
    return [
        RelevanceReading(
            LabelProbs(probs.probs, probs.prefill_tokens + r.prefill_tokens, probs.draft),
            block_states(r, blocks, last),
        )
        for probs, r in zip(inner.relevance(branches), replies, strict=True)
    ]


def read_support(
    inner: Critic,
    model: LanguageModel,
    branches: Sequence[Branch],
    drafts: Sequence[Generation],
    blocks: Sequence[int],
    relevance: Sequence[RelevanceReading | None],
    relevance_blocks: Sequence[int] = (),
    *,
    gain: bool = True,
) -> list[SupportReading]:
    """The combiner's features of each branch: `blocks` read at the support prompt,
    `relevance_blocks` at the relevance prompt. Either may include the last block
    (`model.n_layers − 1`): its output is the final hidden state. `relevance` holds the
    branches' relevance readings where known (with `relevance_blocks`); the others' are read
    here. Without `gain` the draft is not scored without its passage (the feature is 0)."""
    pairs = list(zip(branches, drafts, strict=True))
    grounded = [i for i, (b, d) in enumerate(pairs) if b.passage is not None and d.tokens]
    last, middle = _split(model, blocks)
    chat = inner if isinstance(inner, ChatCritic) else SequenceCritic(model)
    gb = [branches[i] for i in grounded]
    gd = [drafts[i] for i in grounded]
    prompts = [chat.support_prompt(b, d) for b, d in zip(gb, gd, strict=True)]
    extra = [0] * len(grounded)
    states: list[dict[int, tuple[float, ...]]] = [{} for _ in grounded]

    # The source's own support (and, for likelihood, its gain), over all branches.
    support, gains, read_states = _source_support(
        inner, model, branches, drafts, grounded, prompts, blocks, states
    )
    if read_states and prompts:
        requests = read_requests(
            [p for p, _ in prompts], [n for _, n in prompts], hidden=last in blocks, layers=middle
        )
        for k, r in enumerate(model.next_token_logprobs(requests)):
            states[k] = block_states(r, blocks, last)
            extra[k] += r.prefill_tokens

    # The draft's log-probability without its passage, in the layout it was drafted in.
    if gain:
        for k, cost in _closed_book_gains(chat, model, gb, gd, gains).items():
            extra[k] += cost

    # Relevance where the caller does not know it.
    rel = [relevance[i] for i in grounded]
    unknown = [k for k, r in enumerate(rel) if r is None]
    if unknown:
        fresh = read_relevance(inner, model, [gb[k] for k in unknown], relevance_blocks)
        for k, reading in zip(unknown, fresh, strict=True):
            rel[k] = reading
            extra[k] += reading.probs.prefill_tokens

    done = [s for s in support if s is not None]
    assert len(done) == len(pairs)
    out = [SupportReading(s, {}, {}, 0) for s in done]
    for k, i in enumerate(grounded):
        out[i] = _grounded_reading(done[i], gb[k], gd[k], rel[k], gains[k], states[k], extra[k])
    return out


def _grounded_reading(
    support: LabelProbs,
    branch: Branch,
    draft: Generation,
    relevance: RelevanceReading | None,
    gain: float | None,
    states: dict[int, tuple[float, ...]],
    extra: int,
) -> SupportReading:
    """The combiner's features of one branch that has a passage and a non-empty draft."""
    assert branch.passage is not None and relevance is not None
    values = {
        "s_sup": support_score(support.probs),
        "s_rel": relevance_score(relevance.probs.probs),
        "gain": float(gain or 0.0),
        **draft_features(draft.text, len(draft.tokens), branch.passage.text, branch.question),
    }
    named = {probe_name(block, "support"): v for block, v in states.items()}
    named.update({probe_name(block, "relevance"): v for block, v in relevance.states.items()})
    return SupportReading(support, values, named, extra)


def _source_support(
    inner: Critic,
    model: LanguageModel,
    branches: Sequence[Branch],
    drafts: Sequence[Generation],
    grounded: Sequence[int],
    prompts: Sequence[tuple[list[int], int]],
    blocks: Sequence[int],
    states: list[dict[int, tuple[float, ...]]],
) -> tuple[list[LabelProbs | None], list[float | None], bool]:
    """The source's own support of every branch, the likelihood source's gain of the grounded
    ones (None elsewhere), and whether the blocks' states still need a request of their own
    (the learned source reads them with its heads' request, filling `states`)."""
    gains: list[float | None] = [None] * len(grounded)
    support: list[LabelProbs | None] = [None] * len(branches)
    if isinstance(inner, LikelihoodCritic):
        signals = inner.support_signals(branches, drafts)
        support = list(inner.support_from_signals(signals))
        gains = [signals[i].value for i in grounded]
        return support, gains, bool(blocks)
    if not isinstance(inner, LearnedCritic):
        return list(inner.support(branches, drafts)), gains, bool(blocks)
    # The heads' read and the blocks' output come from one engine request.
    last, middle = _split(model, blocks)
    reads = inner.read_with_layers(
        "support", [p for p, _ in prompts], [n for _, n in prompts], middle
    )
    for k, (probs, scores) in enumerate(reads):
        support[grounded[k]] = probs
        states[k] = block_states(scores, blocks, last)
    rest = [i for i in range(len(branches)) if support[i] is None]
    rest_probs = inner.support([branches[i] for i in rest], [drafts[i] for i in rest])
    for i, probs in zip(rest, rest_probs, strict=True):
        support[i] = probs
    return support, gains, False


def _closed_book_gains(
    chat: ChatCritic,
    model: LanguageModel,
    branches: Sequence[Branch],
    drafts: Sequence[Generation],
    gains: list[float | None],
) -> dict[int, int]:
    """Fill the missing `gains`: each draft's mean per-token log-probability with its passage
    minus without it (one continuation request each); returns the prompt tokens each cost."""
    missing = [k for k, g in enumerate(gains) if g is None]
    if not missing:
        return {}
    requests = [
        ContinuationRequest(
            chat.draft_prompt(replace(branches[k], passage=None))[0], drafts[k].tokens
        )
        for k in missing
    ]
    cost: dict[int, int] = {}
    for k, s in zip(missing, model.continuation_logprobs(requests), strict=True):
        gains[k] = (sum(drafts[k].logprobs) - sum(s.logprobs)) / len(drafts[k].tokens)
        cost[k] = s.prefill_tokens
    return cost


def block_states(
    scores: TokenScores, blocks: Sequence[int], last: int | None
) -> dict[int, tuple[float, ...]]:
    """The outputs of `blocks` in an engine reply: the middle ones it tapped, and the last
    block's as the final hidden state."""
    out = {b: scores.layer_states[b] for b in blocks if b in scores.layer_states}
    if last is not None and last in blocks and scores.hidden_state is not None:
        out[last] = scores.hidden_state
    return out


class AnswerabilityCritic:
    """`inner` with s_sup of every grounded, drafted branch replaced by the answerability
    model's p (laid out as `likelihood.support_probs`, so s_sup == p and `min_support` keeps
    its meaning); every other group, and support without passage, are `inner`'s own."""

    def __init__(self, inner: Critic, model: LanguageModel, answerability: AnswerabilityModel):
        if answerability.blocks and model.n_layers is None:
            raise ValueError(
                "the answerability model reads middle layers, which this engine cannot return"
            )
        self.name = inner.name
        self.inner = inner
        self.answerability = answerability
        self._model = model
        self._lock = threading.Lock()
        self._relevance: OrderedDict[tuple[str, str, str, str], RelevanceReading] = OrderedDict()

    @staticmethod
    def _key(b: Branch) -> tuple[str, str, str, str]:
        assert b.passage is not None
        return (b.question, b.prefix, b.passage.id, b.passage.text)

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        return self.inner.retrieval(branches)

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        readings = read_relevance(
            self.inner, self._model, branches, self.answerability.blocks_at("relevance")
        )
        with self._lock:  # the support read uses them as features
            for b, r in zip(branches, readings, strict=True):
                if b.passage is not None:
                    self._relevance[self._key(b)] = r
                    self._relevance.move_to_end(self._key(b))
            while len(self._relevance) > _RELEVANCE_MEMO:
                self._relevance.popitem(last=False)
        return [r.probs for r in readings]

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        return self.inner.draft(branches, max_tokens)

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        with self._lock:
            known = [
                self._relevance.get(self._key(b)) if b.passage is not None else None
                for b in branches
            ]
        fitted = self.answerability
        readings = read_support(
            self.inner,
            self._model,
            branches,
            drafts,
            fitted.blocks_at("support"),
            known,
            fitted.blocks_at("relevance"),
            gain="gain" in fitted.features,
        )
        out = []
        for r in readings:
            if not r.grounded:
                out.append(r.support)
                continue
            p = self.answerability.probability(r.values, r.states)
            out.append(LabelProbs(support_probs(p), r.support.prefill_tokens + r.prefill_tokens))
        return out

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        return self.inner.utility(branches, drafts)
