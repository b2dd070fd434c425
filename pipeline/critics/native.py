"""The `native` critique: the reflection tokens of a Self-RAG checkpoint's own vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

from selfrag.pipeline.critics.base import (
    NATIVE_MARKUP,
    NATIVE_TOKENS,
    RESERVED_PIECES,
    Branch,
    LabelProbs,
    LabelTokens,
    read_groups,
)
from selfrag.pipeline.critics.chat import SequenceCritic
from selfrag.pipeline.prompts import (
    Evidence,
    Part,
    PromptBuilder,
    Tokens,
    Trusted,
    Untrusted,
    passage_text,
)
from selfrag.pipeline.protocols import Generation, GenerationRequest, LanguageModel


def native_token_ids(model: LanguageModel) -> dict[str, LabelTokens] | None:
    """The reflection vocabulary of `model`, or None when it is not a Self-RAG checkpoint."""
    groups: dict[str, LabelTokens] = {}
    for group, labels in NATIVE_TOKENS.items():
        ids: dict[str, tuple[int, ...]] = {}
        for label, piece in labels.items():
            token = model.special_token_id(piece)
            if token is None:
                return None
            ids[label] = (token,)
        groups[group] = LabelTokens(ids)
    return groups


class NativeCritic:
    """Reads reflection tokens from a trained Self-RAG model (prompt format of Asai et al.)."""

    name = "native"

    def __init__(self, model: LanguageModel, groups: dict[str, LabelTokens]) -> None:
        self._model = model
        self._groups = groups
        self._builder = PromptBuilder(model, reserved=[*RESERVED_PIECES, *NATIVE_MARKUP])
        # A segment ends where the model would emit its next reflection token.
        self._stops = frozenset(t for g in groups.values() for t in g.candidates)

    def _head(self, b: Branch) -> list[Part]:
        return [
            Trusted("### Instruction:\n"),
            Untrusted(b.question),
            Trusted("\n\n### Response:\n"),
            Untrusted(b.prefix),
        ]

    def _evidence(self, b: Branch) -> list[Part]:
        assert b.passage is not None
        return [
            *self._head(b),
            Trusted("[Retrieval]<paragraph>"),
            Evidence(passage_text(b.passage)),
            Trusted("</paragraph>"),
        ]

    def _draft_parts(self, b: Branch) -> list[Part]:
        if b.passage is None:
            return [*self._head(b), Trusted("[No Retrieval]")]
        return [*self._evidence(b), Trusted("[Relevant]")]

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        prompts = [self._builder.build(self._head(b)) for b in branches]
        return read_groups(self._model, prompts, self._groups["retrieve"])

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        prompts = [self._builder.build(self._evidence(b)) for b in branches]
        return read_groups(self._model, prompts, self._groups["relevance"])

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        requests = [
            GenerationRequest(
                self._builder.build(self._draft_parts(b)),
                max_tokens,
                self._stops,
                sampling=b.sampling,
                min_tokens=b.min_tokens,
            )
            for b in branches
        ]
        return self._model.generate(requests) if requests else []

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        prompts = [
            self._builder.build([*self._draft_parts(b), Tokens(tuple(d.tokens))])
            for b, d in zip(branches, drafts, strict=True)
        ]
        return read_groups(self._model, prompts, self._groups["support"])

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        # Self-RAG emits [Utility:k] at the end of the response, after the support token.
        sup = self._groups["support"].ids["full"]
        prompts = [
            self._builder.build([*self._draft_parts(b), Tokens(tuple(d.tokens))])
            + ([] if b.passage is None else list(sup))
            for b, d in zip(branches, drafts, strict=True)
        ]
        return read_groups(self._model, prompts, self._groups["utility"])


class NativeChatCritic(SequenceCritic):
    """Reflection tokens of a model exported by `selfrag train --export-gguf`: the chat layout
    as one sequence per branch (declared by the vocabulary token `NATIVE_CHAT_LAYOUT`), read
    through the output matrix."""

    name = "native"

    def __init__(self, model: LanguageModel, groups: dict[str, LabelTokens]) -> None:
        super().__init__(model)
        self._groups = groups

    def _read(
        self, group: str, prompts: Sequence[list[int]], reusable: Sequence[int]
    ) -> list[LabelProbs]:
        # Asked with the hidden state (unused) so that the engine decodes exactly as for the
        # learned reads these rows came from: other batch shapes differ by ~1e-2 nats.
        return read_groups(
            self._model,
            prompts,
            self._groups[group],
            reusable,
            hidden_state=self._model.hidden_size is not None,
        )

    def _stop_tokens(self) -> frozenset[int]:
        return frozenset(t for g in self._groups.values() for t in g.candidates)
