"""The `learned` critique: reflection heads on the frozen model's final hidden state."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from selfrag.pipeline.critics.base import LabelProbs, read_requests
from selfrag.pipeline.critics.chat import SequenceCritic
from selfrag.pipeline.heads import HeadsError, ReflectionHeads
from selfrag.pipeline.protocols import LanguageModel, TokenScores

# Hidden states kept for a second group read at the same position (s_use after s_sup).
_SHARED_READS = 256


class LearnedCritic(SequenceCritic):
    """Reflection heads on the frozen model's final hidden state (`pipeline.heads`), read at
    the same positions as the native-chat critique reads the reflection tokens. Support and
    utility share one position: the hidden state read for one serves the other."""

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
        self._shared: OrderedDict[tuple[int, ...], tuple[float, ...]] = OrderedDict()
        self._shared_lock = threading.Lock()

    def _read(
        self, group: str, prompts: Sequence[list[int]], reusable: Sequence[int]
    ) -> list[LabelProbs]:
        # Only utility is read where another group (support) already was.
        found = [self._take_shared(p) if group == "utility" else None for p in prompts]
        todo = [i for i, h in enumerate(found) if h is None]
        read = self.hidden_states([prompts[i] for i in todo], [reusable[i] for i in todo])
        out = [LabelProbs({}, 0)] * len(prompts)
        for i, h in enumerate(found):
            if h is not None:
                out[i] = LabelProbs(self.heads.groups[group].probabilities(h), 0)
        for i, (h, prefill) in zip(todo, read, strict=True):
            out[i] = LabelProbs(self.heads.groups[group].probabilities(h), prefill)
            if group == "support":
                self._keep_shared(prompts[i], h)
        return out

    def _keep_shared(self, prompt: Sequence[int], hidden: tuple[float, ...]) -> None:
        with self._shared_lock:
            self._shared[tuple(prompt)] = hidden
            while len(self._shared) > _SHARED_READS:
                self._shared.popitem(last=False)

    def _take_shared(self, prompt: Sequence[int]) -> tuple[float, ...] | None:
        """The hidden state a support read left at this very prompt, once."""
        with self._shared_lock:
            return self._shared.pop(tuple(prompt), None) if self._shared else None

    def read_with_layers(
        self,
        group: str,
        prompts: Sequence[list[int]],
        reusable: Sequence[int],
        layers: Sequence[int],
    ) -> list[tuple[LabelProbs, TokenScores]]:
        """The group's label probabilities after each prompt and the engine's reply to the
        same request, which also carries the output of the middle blocks `layers` there
        (`pipeline.answerability_model` probes it) and the final hidden state."""
        if not prompts:
            return []
        out = []
        requests = read_requests(prompts, reusable, hidden=True, layers=layers)
        for r in self._model.next_token_logprobs(requests):
            if r.hidden_state is None:
                raise RuntimeError("the engine returned no hidden state for a learned critique")
            probs = self.heads.groups[group].probabilities(r.hidden_state)
            out.append((LabelProbs(probs, r.prefill_tokens), r))
            if group == "support":
                self._keep_shared(requests[len(out) - 1].prompt, r.hidden_state)
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
