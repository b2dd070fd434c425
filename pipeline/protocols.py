"""The small interfaces through which the algorithm reaches engines, retrievers and caches.

`pipeline/` imports nothing heavier than these; `infra/` provides the implementations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["eos", "stop_token", "sentence", "length"]


@dataclass(frozen=True)
class TokenScoreRequest:
    """Ask for the log-probabilities of `candidates` as the token right after `prompt`."""

    prompt: Sequence[int]
    candidates: Sequence[int]
    reusable_prefix: int = 0
    """Leading prompt tokens that form a content-addressed reusable prefix (template + passage,
    the same for any question): an engine may save their KV state and restore it later instead
    of recomputing it. 0: no such prefix."""
    hidden_state: bool = False
    """Also return the final hidden state (after the output norm) at the last prompt token:
    the vector the output matrix turns into these logits."""
    hidden_layers: tuple[int, ...] = ()
    """Also return the output of these transformer blocks (counted from 0, before the last
    one) at the last prompt token (`TokenScores.layer_states`)."""


@dataclass(frozen=True)
class TokenScores:
    """Log-probabilities aligned with the request's candidates (`-inf` for an impossible token)."""

    logprobs: list[float]
    prefill_tokens: int
    hidden_state: tuple[float, ...] | None = None
    """The final hidden state at the last prompt token, when the request asked for it."""
    layer_states: dict[int, tuple[float, ...]] = field(default_factory=dict)
    """The output of each block of `TokenScoreRequest.hidden_layers` at the last prompt token."""


@dataclass(frozen=True)
class Sampling:
    """How a generation picks its tokens when not greedily: the logits divided by
    `temperature`, the smallest set of tokens holding `top_p` of the probability, one drawn.

    With a `seed` the draws are a function of the seed and the prompt alone (not of the other
    sequences of a batch), so the same request gives the same text; without one they differ."""

    temperature: float
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """Continuation of `prompt` for at most `max_tokens` tokens: greedy, or drawn as
    `sampling` says.

    Generation stops at an end-of-generation token, at any token in `stop_token_ids`
    (kept out of the text, reported in `Generation.stop_token`), or, when
    `stop_at_sentence_end` is set, once the text so far ends a sentence.
    """

    prompt: Sequence[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_at_sentence_end: bool = True
    reusable_prefix: int = 0
    """Leading prompt tokens that form a content-addressed reusable prefix (template + passage,
    the same for any question): an engine may save their KV state and restore it later instead
    of recomputing it. 0: no such prefix."""
    sampling: Sampling | None = None
    """None (or a temperature of 0): greedy. `Generation.logprobs` are the model's own
    log-probabilities of the chosen tokens either way."""
    min_tokens: int = 0
    """No end-of-generation or stop token is chosen before this many tokens (vLLM's
    `min_tokens`): the next most likely token is taken instead."""


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason
    prefill_tokens: int
    stop_token: int | None = None

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclass(frozen=True)
class ContinuationRequest:
    """Ask for the log-probability of each token of `continuation` given `prompt`."""

    prompt: Sequence[int]
    continuation: Sequence[int]
    reusable_prefix: int = 0
    """Leading prompt tokens that form a content-addressed reusable prefix (template + passage,
    the same for any question): an engine may save their KV state and restore it later instead
    of recomputing it. 0: no such prefix."""


@dataclass(frozen=True)
class ContinuationScores:
    logprobs: list[float]
    prefill_tokens: int


@runtime_checkable
class LanguageModel(Protocol):
    """A tokenizer plus batched scoring and greedy generation.

    Every batched call takes all its requests at once so that an implementation can run
    them as one multi-sequence forward pass and compute shared prompt prefixes only once.
    """

    @property
    def model_id(self) -> str: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def hidden_size(self) -> int | None:
        """Length of the hidden states `next_token_logprobs` returns when a request asks
        (`TokenScoreRequest.hidden_state`); None when this engine cannot return them."""
        ...

    @property
    def n_layers(self) -> int | None:
        """How many transformer blocks the model has, when this engine can return the output
        of any of them (`TokenScoreRequest.hidden_layers`); else None."""
        ...

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Tokenize without adding BOS. With `special=False` no control token can appear."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def special_token_id(self, piece: str) -> int | None:
        """The id of `piece` when the vocabulary holds it as one token, else None."""
        ...

    def bos_tokens(self) -> list[int]:
        """Tokens every prompt starts with (empty when the model adds no BOS)."""
        ...

    def next_token_logprobs(self, requests: Sequence[TokenScoreRequest]) -> list[TokenScores]: ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]: ...

    def continuation_logprobs(
        self, requests: Sequence[ContinuationRequest]
    ) -> list[ContinuationScores]: ...


COLLECTION = "collection"
"""The `Passage.metadata` key naming the collection a passage was indexed from (the corpus
file or folder), when the index recorded it."""


@dataclass(frozen=True)
class Passage:
    id: str
    text: str
    title: str | None = None
    score: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    similarity: float | None = None
    """The retriever's dense score: the embedder's cosine of the query that found the passage
    and the passage (`score` is a fused rank score when the search is hybrid); None when the
    retriever gives none."""

    def shown(self) -> dict[str, object]:
        """The fields an answer shows of this passage (`schemas.answer.PassageOut`'s)."""
        return {
            "id": self.id,
            "title": self.title,
            "url": self.metadata.get("url"),
            "text": self.text,
            "score": self.score,
            "similarity": self.similarity,
            "corpus": self.metadata.get(COLLECTION),
        }


@runtime_checkable
class PassageSearch(Protocol):
    """Searches passages for a query: the store in this process, or one behind an actor."""

    def search(self, query: str, k: int) -> list[Passage]: ...

    def search_many(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        """`search` for each query, in order: a step's searches as one call."""
        ...
