"""The answerability critique: any source, with s_sup replaced by `pipeline.answerability`'s p.

`read_support` is the one place the combiner's features are read, for the critique at answer
time and for fitting (`jobs.answerability`): the source's own support probabilities, the
middle blocks' output at the chat layout's support prompt (in the same engine request as the
learned heads' read; one extra request for other sources), and the draft's log-probability
without its passage (one continuation request per grounded branch).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from selfrag.pipeline.answerability import AnswerabilityModel, draft_features
from selfrag.pipeline.critics.base import Branch, Critic, LabelProbs, read_requests
from selfrag.pipeline.critics.chat import ChatCritic
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
class SupportReading:
    """What the combiner reads of one branch: the source's support, the named features and
    the blocks' output (empty for a branch without passage or draft)."""

    support: LabelProbs
    values: dict[str, float]
    states: dict[int, tuple[float, ...]]
    prefill_tokens: int

    @property
    def grounded(self) -> bool:
        return bool(self.values)


def read_support(
    inner: Critic,
    model: LanguageModel,
    branches: Sequence[Branch],
    drafts: Sequence[Generation],
    blocks: Sequence[int],
    relevance: Sequence[float | None],
) -> list[SupportReading]:
    """The combiner's features of each branch. `blocks` may include the last block
    (`model.n_layers − 1`): its output is the final hidden state. `relevance` holds the
    branches' s_rel where known; the others' is read from `inner`."""
    pairs = list(zip(branches, drafts, strict=True))
    grounded = [i for i, (b, d) in enumerate(pairs) if b.passage is not None and d.tokens]
    last = (model.n_layers - 1) if model.n_layers is not None else None
    middle = tuple(b for b in blocks if b != last)
    if middle and model.n_layers is None:
        raise ValueError("the answerability model reads middle layers, which this engine cannot")
    chat = inner if isinstance(inner, ChatCritic) else ChatCritic(model)
    gb = [branches[i] for i in grounded]
    gd = [drafts[i] for i in grounded]
    prompts = [chat.support_prompt(b, d) for b, d in zip(gb, gd, strict=True)]
    extra = [0] * len(grounded)
    states: list[dict[int, tuple[float, ...]]] = [{} for _ in grounded]

    # The source's own support (and, for likelihood, its gain), over all branches.
    gains: list[float | None] = [None] * len(grounded)
    support: list[LabelProbs | None] = [None] * len(pairs)
    read_states = bool(blocks)
    if isinstance(inner, LikelihoodCritic):
        signals = inner.support_signals(branches, drafts)
        support = list(inner.support_from_signals(signals))
        gains = [signals[i].value for i in grounded]
    elif isinstance(inner, LearnedCritic):
        # The heads' read and the blocks' output come from one engine request.
        reads = inner.read_with_layers(
            "support", [p for p, _ in prompts], [n for _, n in prompts], middle
        )
        for k, (probs, scores) in enumerate(reads):
            support[grounded[k]] = probs
            states[k] = block_states(scores, blocks, last)
        rest = [i for i in range(len(pairs)) if support[i] is None]
        rest_probs = inner.support([branches[i] for i in rest], [drafts[i] for i in rest])
        for i, probs in zip(rest, rest_probs, strict=True):
            support[i] = probs
        read_states = False
    else:
        support = list(inner.support(branches, drafts))

    if read_states and prompts:
        requests = read_requests(
            [p for p, _ in prompts], [n for _, n in prompts], hidden=last in blocks, layers=middle
        )
        for k, r in enumerate(model.next_token_logprobs(requests)):
            states[k] = block_states(r, blocks, last)
            extra[k] += r.prefill_tokens

    # The draft's log-probability without its passage, in the layout it was drafted in.
    missing = [k for k, g in enumerate(gains) if g is None]
    if missing:
        requests_c = [
            ContinuationRequest(chat.draft_prompt(replace(gb[k], passage=None))[0], gd[k].tokens)
            for k in missing
        ]
        for k, s in zip(missing, model.continuation_logprobs(requests_c), strict=True):
            gains[k] = (sum(gd[k].logprobs) - sum(s.logprobs)) / len(gd[k].tokens)
            extra[k] += s.prefill_tokens

    # s_rel where the caller does not know it.
    rel = [relevance[i] for i in grounded]
    unknown = [k for k, r in enumerate(rel) if r is None]
    if unknown:
        for k, probs in zip(unknown, inner.relevance([gb[k] for k in unknown]), strict=True):
            rel[k] = relevance_score(probs.probs)
            extra[k] += probs.prefill_tokens

    done = [s for s in support if s is not None]
    assert len(done) == len(pairs)
    out = [SupportReading(s, {}, {}, 0) for s in done]
    for k, i in enumerate(grounded):
        b, d = gb[k], gd[k]
        assert b.passage is not None
        values = {
            "s_sup": support_score(done[i].probs),
            "s_rel": float(rel[k] if rel[k] is not None else 0.5),
            "gain": float(gains[k] or 0.0),
            **draft_features(d.text, len(d.tokens), b.passage.text, b.question),
        }
        out[i] = SupportReading(done[i], values, states[k], extra[k])
    return out


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
        last = (model.n_layers - 1) if model.n_layers is not None else None
        if any(b != last for b in answerability.blocks) and model.n_layers is None:
            raise ValueError(
                "the answerability model reads middle layers, which this engine cannot return"
            )
        self.name = inner.name
        self.inner = inner
        self.answerability = answerability
        self._model = model
        self._lock = threading.Lock()
        self._relevance: OrderedDict[tuple[str, str, str, str], float] = OrderedDict()

    @staticmethod
    def _key(b: Branch) -> tuple[str, str, str, str]:
        assert b.passage is not None
        return (b.question, b.prefix, b.passage.id, b.passage.text)

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        return self.inner.retrieval(branches)

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        out = self.inner.relevance(branches)
        with self._lock:  # the support read uses s_rel as a feature
            for b, probs in zip(branches, out, strict=True):
                if b.passage is not None:
                    self._relevance[self._key(b)] = relevance_score(probs.probs)
                    self._relevance.move_to_end(self._key(b))
            while len(self._relevance) > _RELEVANCE_MEMO:
                self._relevance.popitem(last=False)
        return out

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        return self.inner.draft(branches, max_tokens)

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        with self._lock:
            known = [
                self._relevance.get(self._key(b)) if b.passage is not None else None
                for b in branches
            ]
        readings = read_support(
            self.inner, self._model, branches, drafts, self.answerability.blocks, known
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
