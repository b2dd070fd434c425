"""The critiques mark "template + passage" as each prompt's reusable prefix (`reusable_prefix`)."""

from __future__ import annotations

from typing import Any

from selfrag.pipeline.critics import Branch, PromptedCritic
from selfrag.pipeline.critics.likelihood import LikelihoodCritic
from selfrag.pipeline.protocols import ContinuationScores, Generation, Passage
from tests.fakes import WordModel

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PASSAGE = Passage("p1", "Rollo founded Normandy in 911.", "Normans")


class Recorder(WordModel):
    """WordModel that keeps every request it is sent."""

    def __init__(self) -> None:
        super().__init__(specials=["<|im_start|>", "<|im_end|>"], template=CHATML)
        self.requests: list[Any] = []

    def next_token_logprobs(self, requests):  # type: ignore[no-untyped-def]
        self.requests += requests
        return super().next_token_logprobs(requests)

    def generate(self, requests):  # type: ignore[no-untyped-def]
        self.requests += requests
        return super().generate(requests)

    def continuation_logprobs(self, requests):  # type: ignore[no-untyped-def]
        self.requests += requests
        return [ContinuationScores([-1.0] * len(r.continuation), len(r.prompt)) for r in requests]


def _check(model: Recorder, n_with_passage: int) -> None:
    marked = [r for r in model.requests if r.reusable_prefix]
    assert len(marked) == n_with_passage
    heads = {tuple(r.prompt[: r.reusable_prefix]) for r in marked}
    # One prefix for both questions: it ends with the passage, before any question text.
    assert len(heads) == 1
    text = model.detokenize(list(next(iter(heads))))
    assert text.endswith("Normans\nRollo founded Normandy in 911.\n\n") and "Question" not in text
    assert all(r.reusable_prefix < len(r.prompt) for r in marked)


def test_prompted_critic_marks_the_passage_prefix():
    model = Recorder()
    critic = PromptedCritic(model)
    branches = [
        Branch("Who founded Normandy?", "", PASSAGE),
        Branch("When was Normandy founded?", "", PASSAGE),
        Branch("Who founded Normandy?", "", None),
    ]
    critic.relevance(branches[:2])
    drafts = critic.draft(branches, 8)
    critic.support(branches, drafts)
    critic.utility(branches, drafts)
    # relevance 2, draft 2 of 3, support 2 of 3 carry a passage; utility judges (x, y_t) only.
    _check(model, 6)
    assert sum(1 for r in model.requests if not r.reusable_prefix) == 5


def test_likelihood_critic_marks_the_passage_prefix():
    model = Recorder()
    critic = LikelihoodCritic(model)
    branches = [
        Branch("Who founded Normandy?", "", PASSAGE),
        Branch("When was Normandy founded?", "", PASSAGE),
    ]
    critic.relevance(branches)
    critic.draft(branches, 8)
    # Question baselines (no passage) carry no prefix; the two relevance and two drafts do.
    _check(model, 4)
    closed = Generation([1], "x", [-0.1], "eos", 0)
    critic.support(branches, [closed, closed])  # closed-book prompts: no passage, no prefix
    _check(model, 4)
