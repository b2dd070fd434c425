"""What every critique source shares: the branch it judges, the label probabilities it returns,
the `Critic` protocol, and the reflection vocabulary of Self-RAG."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from selfrag.pipeline.protocols import (
    Generation,
    LanguageModel,
    Passage,
    Sampling,
    TokenScoreRequest,
)

RETRIEVE_LABELS = ("yes", "no", "continue")
RELEVANCE_LABELS = ("relevant", "irrelevant")
SUPPORT_LABELS = ("full", "partial", "none")
UTILITY_LABELS = ("1", "2", "3", "4", "5")


@dataclass(frozen=True)
class Branch:
    """One candidate continuation: a question, the answer so far, and at most one passage."""

    question: str
    prefix: str
    passage: Passage | None
    sampling: Sampling | None = None
    """How the branch's draft picks its tokens (None: greedily); critique reads ignore it."""
    min_tokens: int = 0
    """Tokens its draft must write before it may end (`GenerationRequest.min_tokens`): an
    account's continuation, where a small model would end its turn after the answer so far."""


@dataclass(frozen=True)
class LabelProbs:
    """Probabilities of a reflection group's labels, and the prompt tokens it cost."""

    probs: dict[str, float]
    prefill_tokens: int
    draft: Generation | None = None
    """A retrieval decision read from a closed-book draft (likelihood) carries that draft: it
    is the hypothesis's no-retrieval draft (prompt already paid for: `prefill_tokens` 0)."""


class Critic(Protocol):
    """A source of reflection probabilities. All methods take and return batches."""

    name: str

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]: ...

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]: ...

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]: ...

    def support(
        self, branches: Sequence[Branch], drafts: Sequence[Generation]
    ) -> list[LabelProbs]: ...

    def utility(
        self, branches: Sequence[Branch], drafts: Sequence[Generation]
    ) -> list[LabelProbs]: ...


@dataclass(frozen=True)
class LabelTokens:
    """Token ids that stand for each label of a group (several surface forms may map to one)."""

    ids: Mapping[str, tuple[int, ...]]

    @property
    def candidates(self) -> list[int]:
        return [t for ids in self.ids.values() for t in ids]

    def probabilities(self, logprobs: Sequence[float]) -> dict[str, float]:
        it = iter(logprobs)
        out: dict[str, float] = {}
        for label, ids in self.ids.items():
            mass = 0.0
            for _ in ids:
                lp = next(it)
                mass += math.exp(lp) if lp != -math.inf else 0.0
            out[label] = mass
        return out


def read_groups(
    model: LanguageModel,
    prompts: Sequence[list[int]],
    labels: LabelTokens,
    reusable: Sequence[int] | None = None,
    *,
    hidden_state: bool = False,
) -> list[LabelProbs]:
    if not prompts:
        return []
    prefixes = reusable if reusable is not None else [0] * len(prompts)
    requests = [
        TokenScoreRequest(
            prompt=p,
            candidates=labels.candidates,
            reusable_prefix=n,
            hidden_state=hidden_state,
        )
        for p, n in zip(prompts, prefixes, strict=True)
    ]
    return [
        LabelProbs(labels.probabilities(r.logprobs), r.prefill_tokens)
        for r in model.next_token_logprobs(requests)
    ]


NATIVE_TOKENS: dict[str, dict[str, str]] = {
    "retrieve": {
        "yes": "[Retrieval]",
        "no": "[No Retrieval]",
        "continue": "[Continue to Use Evidence]",
    },
    "relevance": {"relevant": "[Relevant]", "irrelevant": "[Irrelevant]"},
    "support": {
        "full": "[Fully supported]",
        "partial": "[Partially supported]",
        "none": "[No support / Contradictory]",
    },
    "utility": {str(i): f"[Utility:{i}]" for i in range(1, 6)},
}
NATIVE_MARKUP = ("<paragraph>", "</paragraph>")
# The read positions reflection heads are trained at: the chat layout as one growing sequence
# per branch (`SequenceCritic`). Heads and answerability models record it; others are refused.
READ_LAYOUT = "chat-sequence"
# A control token in the vocabulary of a model exported by `selfrag train --export-gguf`: its
# reflection rows were trained at the positions of `READ_LAYOUT`, not of the Asai et al.
# prompt format.
NATIVE_CHAT_LAYOUT = f"<|reflection_layout:{READ_LAYOUT}|>"
# The marker of exports made for the read positions of selfrag before `READ_LAYOUT`.
NATIVE_EARLIER_LAYOUTS = ("<|reflection_layout:chat|>",)
# Pieces no untrusted text may spell in a prompt (`PromptBuilder(reserved=...)`).
RESERVED_PIECES = tuple(p for group in NATIVE_TOKENS.values() for p in group.values())


def read_requests(
    prompts: Sequence[list[int]],
    reusable: Sequence[int],
    *,
    hidden: bool,
    layers: Sequence[int] = (),
) -> list[TokenScoreRequest]:
    """The engine requests of a learned read: no candidate tokens, the hidden state or not,
    and the output of the middle blocks `layers` (none by default)."""
    return [
        TokenScoreRequest(
            prompt=p,
            candidates=(),
            reusable_prefix=n,
            hidden_state=hidden,
            hidden_layers=tuple(layers),
        )
        for p, n in zip(prompts, reusable, strict=True)
    ]
