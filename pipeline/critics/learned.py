"""The `learned` critique: reflection heads on the frozen model's final hidden state."""

from __future__ import annotations

from collections.abc import Sequence

from selfrag.pipeline.critics.base import LabelProbs, read_requests
from selfrag.pipeline.critics.chat import ChatCritic
from selfrag.pipeline.heads import HeadsError, ReflectionHeads
from selfrag.pipeline.protocols import LanguageModel, TokenScores


class LearnedCritic(ChatCritic):
    """Reflection heads on the frozen model's final hidden state (`pipeline.heads`), read at
    the same positions as the native-chat critique reads the reflection tokens."""

    name = "learned"

    def __init__(self, model: LanguageModel, heads: ReflectionHeads) -> None:
        if model.hidden_size is None:
            raise ValueError(
                "critique 'learned' needs the model's hidden states, which this engine cannot "
                "return (use 'likelihood' or 'prompted')"
            )
        if model.hidden_size != heads.hidden_size:
            raise HeadsError(
                f"heads of hidden size {heads.hidden_size} for a model of hidden size "
                f"{model.hidden_size}"
            )
        super().__init__(model)
        self.heads = heads

    def _read(
        self, group: str, prompts: Sequence[list[int]], reusable: Sequence[int]
    ) -> list[LabelProbs]:
        return [
            LabelProbs(self.heads.groups[group].probabilities(h), prefill)
            for h, prefill in self.hidden_states(prompts, reusable)
        ]

    def read_with_layers(
        self,
        group: str,
        prompts: Sequence[list[int]],
        reusable: Sequence[int],
        layers: Sequence[int],
    ) -> list[tuple[LabelProbs, TokenScores]]:
        """The group's label probabilities after each prompt and the engine's reply to the
        same request, which also carries the output of the middle blocks `layers` there
        (`pipeline.answerability` probes it) and the final hidden state."""
        if not prompts:
            return []
        out = []
        requests = read_requests(prompts, reusable, hidden=True, layers=layers)
        for r in self._model.next_token_logprobs(requests):
            if r.hidden_state is None:
                raise RuntimeError("the engine returned no hidden state for a learned critique")
            probs = self.heads.groups[group].probabilities(r.hidden_state)
            out.append((LabelProbs(probs, r.prefill_tokens), r))
        return out

    def hidden_states(
        self, prompts: Sequence[list[int]], reusable: Sequence[int]
    ) -> list[tuple[tuple[float, ...], int]]:
        """The final hidden state after each prompt and the prompt tokens it cost."""
        if not prompts:
            return []
        out = []
        for r in self._model.next_token_logprobs(read_requests(prompts, reusable, hidden=True)):
            if r.hidden_state is None:
                raise RuntimeError("the engine returned no hidden state for a learned critique")
            out.append((r.hidden_state, r.prefill_tokens))
        return out
