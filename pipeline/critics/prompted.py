"""The `prompted` critique: any instruct model's answer-token probabilities under short
questions in the chat layout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from selfrag.pipeline.critics.base import LabelProbs, LabelTokens, read_groups
from selfrag.pipeline.critics.chat import ChatCritic, PromptedQuestions
from selfrag.pipeline.protocols import LanguageModel


def first_token_labels(model: LanguageModel, words: Mapping[str, Sequence[str]]) -> LabelTokens:
    """Map each label to the first tokens of its answer words; a token claimed by two labels
    is dropped from both so one surface form never counts for two answers."""
    claims: dict[int, set[str]] = {}
    per_label: dict[str, list[int]] = {}
    for label, forms in words.items():
        ids: list[int] = []
        for form in forms:
            tokens = model.tokenize(form, special=False)
            if tokens and tokens[0] not in ids:
                ids.append(tokens[0])
                claims.setdefault(tokens[0], set()).add(label)
        per_label[label] = ids
    out: dict[str, tuple[int, ...]] = {}
    for label, ids in per_label.items():
        kept = tuple(t for t in ids if len(claims[t]) == 1)
        if not kept:
            raise ValueError(f"label {label!r} has no answer token of its own in this vocabulary")
        out[label] = kept
    return LabelTokens(out)


class PromptedCritic(ChatCritic):
    """Critique from any instruct model's answer-token probabilities under short questions."""

    name = "prompted"

    def __init__(self, model: LanguageModel, questions: PromptedQuestions | None = None) -> None:
        super().__init__(model, questions)
        self._labels = {
            group: first_token_labels(model, words) for group, words in self._q.label_words.items()
        }

    def _read(
        self, group: str, prompts: Sequence[list[int]], reusable: Sequence[int]
    ) -> list[LabelProbs]:
        return read_groups(self._model, prompts, self._labels[group], reusable)
