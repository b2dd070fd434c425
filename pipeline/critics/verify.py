"""The verified support read: the generator's own yes/no to whether the passage states a draft.

After a branch drafts on its passage, the model is asked, in a conversation of its own that
starts with the same system + passage head as the branch's other prompts (so that head's KV
state is reused), whether the passage states that the draft answers the question. The
probability of "yes" against "no" at the first answer token becomes the branch's IsSup
distribution (`full` = p, `none` = 1 − p), so s_sup is that probability. The question names the
draft in full: the model judges a stated claim against the passage rather than trusting the
assistant turn it wrote itself. Any critique source can take its support from this read
(`VerifiedCritic`); its other groups are the source's own. A draft that states a number or a
name its passage (title and text) lacks, or whose words no one sentence of the passage holds
(`pipeline.grounding`), cannot be fully supported whatever the model says: s_sup is p(yes)
times its grounding score.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from selfrag.pipeline.critics.base import RESERVED_PIECES, Branch, Critic, LabelProbs, read_groups
from selfrag.pipeline.critics.chat import ChatCritic
from selfrag.pipeline.critics.prompted import first_token_labels
from selfrag.pipeline.grounding import GROUNDING_RULE, grounding_score
from selfrag.pipeline.prompts import (
    Part,
    PromptBuilder,
    Trusted,
    Untrusted,
    chat_glue,
    evidence_head,
    passage_text,
)
from selfrag.pipeline.protocols import Generation, LanguageModel

VERIFY_QUESTION = (
    "Question: {question}\nAnswer: {answer}\n\n"
    'Does the passage state that the answer to the question is "{answer}"? Reply yes or no.'
)
"""The verification question, after the passage. Each placeholder is untrusted text."""
FOLLOW_UP_QUESTION = (
    'Does the passage state that the answer to the question is "{answer}"? Reply yes or no.'
)
"""The verification question as a user turn after the draft, on the drafting sequence."""
VERIFY_WORDS: dict[str, tuple[str, ...]] = {
    "yes": ("yes", "Yes", " yes", " Yes"),
    "no": ("no", "No", " no", " No"),
}


def verified_support_id() -> str:
    """A short digest of the verification question and the grounding rule that weighs its
    read: reads, thresholds calibrated on them and answers cached with them belong to one
    wording and rule (either changed reads differently)."""
    return hashlib.sha256(f"{VERIFY_QUESTION}\n{GROUNDING_RULE}".encode()).hexdigest()[:12]


class VerifyReader:
    """Builds the verification prompt of a drafted branch and reads p(yes) after it."""

    def __init__(self, model: LanguageModel, drafting: ChatCritic | None = None) -> None:
        """Without `drafting` the question is a conversation of its own after the system +
        passage head (the critique's read); with it (the source that drafts, in the chat
        layout) a user turn after the draft on the branch's drafting sequence, whose KV state
        the engine still holds (measured as an alternative: notes/evaluation.md, *Which read tells
        a supported draft from an unsupported one*)."""
        self._model = model
        self._drafting = drafting
        self._glue = chat_glue(model.chat_template)
        self._builder = PromptBuilder(model, reserved=RESERVED_PIECES)
        self._labels = first_token_labels(model, VERIFY_WORDS)

    def prompt(self, b: Branch, draft: Generation) -> tuple[list[int], int]:
        """The prompt tokens and the length of its reusable head (system + passage)."""
        if b.passage is None:
            raise ValueError("a verification read needs the branch's passage")
        values = {"question": b.question, "answer": draft.text.strip()}
        if self._drafting is not None:
            return self._drafting.follow_up_prompt(b, draft, _parts(FOLLOW_UP_QUESTION, values))
        head = evidence_head(self._glue, b.passage)
        parts = [*head, *_parts(VERIFY_QUESTION, values), Trusted(self._glue.assistant_start)]
        return self._builder.build_split(parts, len(head))

    def read(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        """p(yes) and p(no) (normalised over the two) after each branch's prompt."""
        built = [self.prompt(b, d) for b, d in zip(branches, drafts, strict=True)]
        raw = read_groups(self._model, [p for p, _ in built], self._labels, [n for _, n in built])
        out = []
        for r in raw:
            yes, no = r.probs.get("yes", 0.0), r.probs.get("no", 0.0)
            p = yes / (yes + no) if yes + no > 0 else 0.5
            out.append(LabelProbs({"yes": p, "no": 1.0 - p}, r.prefill_tokens))
        return out


def _parts(template: str, values: dict[str, str]) -> list[Part]:
    """`template` as parts: its text trusted, each {placeholder}'s value untrusted."""
    parts: list[Part] = []
    rest = template
    while "{" in rest:
        before, _, after = rest.partition("{")
        name, _, rest = after.partition("}")
        parts += [Trusted(before), Untrusted(values[name])]
    return [*parts, Trusted(rest)]


def support_from_verdict(verdict: LabelProbs, grounding: float | None = None) -> LabelProbs:
    """The IsSup distribution a verification read stands for: full = p(yes) times the draft's
    `grounding_score` in its passage and question (`grounding`; None: 1), none = the rest."""
    p = verdict.probs["yes"] * (1.0 if grounding is None else grounding)
    return LabelProbs({"full": p, "partial": 0.0, "none": 1.0 - p}, verdict.prefill_tokens)


def verified_support(
    reader: VerifyReader, branches: Sequence[Branch], drafts: Sequence[Generation]
) -> list[LabelProbs]:
    """The IsSup distributions of drafted branches by `reader`'s verification read and each
    draft's grounding in its passage and question (`support_from_verdict`): the critique's
    support, and a critic model's labels for training (`pipeline.learning.critic_labels`)."""
    verdicts = reader.read(branches, drafts)
    return [
        support_from_verdict(
            v, grounding_score(d.text, passage_text(b.passage), b.question) if b.passage else None
        )
        for b, d, v in zip(branches, drafts, verdicts, strict=True)
    ]


class VerifiedCritic:
    """A critique source whose support is the verification read (`VerifyReader`); every other
    group, drafting included, is the source's own (a source that reads utility where it read
    support reads it there on its own)."""

    def __init__(self, inner: Critic, model: LanguageModel) -> None:
        self.inner = inner
        self.name = inner.name
        # A conversation of its own, not a turn on the drafting sequence: asked after its own
        # answer the model mostly agrees with itself (notes/evaluation.md, same section).
        self._reader = VerifyReader(model)

    def __getattr__(self, attribute: str) -> object:
        # Reads that only some sources have (hidden states, layer taps) stay the source's.
        return getattr(self.inner, attribute)

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        return self.inner.retrieval(branches)

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        return self.inner.relevance(branches)

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        return self.inner.draft(branches, max_tokens)

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        return verified_support(self._reader, branches, drafts)

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        return self.inner.utility(branches, drafts)
