"""The chat layout shared by the prompted, learned and native-chat critique sources."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from selfrag.pipeline.critics.base import RESERVED_PIECES, Branch, LabelProbs
from selfrag.pipeline.prompts import (
    ChatGlue,
    Part,
    PromptBuilder,
    Tokens,
    Trusted,
    Untrusted,
    chat_glue,
    evidence_head,
    system_head,
)
from selfrag.pipeline.protocols import Generation, GenerationRequest, LanguageModel


@dataclass(frozen=True)
class PromptedQuestions:
    """The wording of the prompted critique. Answers are read from the first answer token."""

    retrieve: str = (
        "Question: {question}\n{answer_so_far}"
        "Does answering this question need facts looked up in a reference text? Answer Yes or No."
    )
    relevance: str = (
        "Does the passage above contain the information needed to answer the question? "
        "Answer Yes or No."
    )
    draft: str = "Answer the question in one or two sentences, using only the passage above."
    draft_closed: str = "Answer the question in one or two sentences."
    support: str = (
        "Is every claim of your answer stated in the passage? Answer Fully, Partially or No."
    )
    utility: str = (
        "Rate how well your answer answers the question, from 1 (useless) to 5 (complete). "
        "Reply with one digit."
    )
    critique: str = (
        "Is every claim of your answer stated in the passage, and does it answer the question?"
    )
    """The one cue after a draft at which the sequence layout (`SequenceCritic`) reads both
    support and utility."""
    label_words: dict[str, dict[str, tuple[str, ...]]] = field(
        default_factory=lambda: {
            "retrieve": {"yes": ("Yes", "yes"), "no": ("No", "no")},
            "relevance": {"relevant": ("Yes", "yes"), "irrelevant": ("No", "no")},
            "support": {
                "full": ("Fully", "fully", "Yes"),
                "partial": ("Partially", "partially", "Part"),
                "none": ("No", "no"),
            },
            "utility": {str(i): (str(i),) for i in range(1, 6)},
        }
    )


class ChatCritic:
    """The chat layout shared by the prompted, learned and native-chat critique.

    Every group is read at the end of a short conversation: [system, user(passage, question,
    task), assistant] for retrieval and relevance, and [..., assistant(draft), user(critique
    question), assistant] for support and utility. The passage comes first, so "system +
    passage" is a prefix shared by the relevance, drafting and support prompts of a branch (and
    reusable across questions). Data flow as in the paper: Retrieve after (x, y<t), IsRel after
    (x, d), IsSup after (x, d, y_t), IsUse after (x, y_t). Subclasses say how a group is read.
    """

    name = "chat"

    def __init__(self, model: LanguageModel, questions: PromptedQuestions | None = None) -> None:
        self._model = model
        self._q = questions or PromptedQuestions()
        self._glue: ChatGlue = chat_glue(model.chat_template)
        self._builder = PromptBuilder(model, reserved=RESERVED_PIECES)

    def _read(
        self, group: str, prompts: Sequence[list[int]], reusable: Sequence[int]
    ) -> list[LabelProbs]:
        """The label probabilities of `group` as the next token after each prompt."""
        raise NotImplementedError

    def _stop_tokens(self) -> frozenset[int]:
        return frozenset()

    # The conversation is [system, user(evidence + task), assistant(answer), user(critique)].
    def _user(self, b: Branch, task: str) -> list[Part]:
        parts = self._evidence_head(b)
        parts += [Trusted("Question: "), Untrusted(b.question), Trusted("\n\n" + task)]
        return parts

    def _evidence_head(self, b: Branch) -> list[Part]:
        """The start of every prompt of `b` up to the end of its passage: the same for any
        question, so its KV state is reusable (`reusable_prefix`)."""
        return evidence_head(self._glue, b.passage)

    def _build(self, b: Branch, parts: Sequence[Part]) -> tuple[list[int], int]:
        """Prompt tokens and the reusable prefix length (0 without a passage)."""
        if b.passage is None:
            return self._builder.build(parts), 0
        return self._builder.build_split(parts, len(self._evidence_head(b)))

    def _answer(self, b: Branch) -> list[Part]:
        task = self._q.draft if b.passage is not None else self._q.draft_closed
        parts = [*self._user(b, task), Trusted(self._glue.assistant_start)]
        if b.prefix:
            parts.append(Untrusted(b.prefix))
        return parts

    def _follow_up(self, b: Branch, d: Generation, question: str) -> tuple[list[int], int]:
        return self.follow_up_prompt(b, d, [Trusted(question)])

    def follow_up_prompt(
        self, b: Branch, d: Generation, question: Sequence[Part]
    ) -> tuple[list[int], int]:
        """The branch's drafting prompt, its draft `d`, and a user turn of `question` (parts,
        untrusted ones neutralised) ending where the assistant answers: the sequence the
        branch drafted on, extended, so its KV state is reused. (Prompt, reusable prefix.)"""
        g = self._glue
        turn = list(question)
        # The glue joins the first and last trusted parts, as one piece of template text is
        # tokenized (a separate piece could split into other tokens).
        if turn and isinstance(turn[0], Trusted):
            turn[0] = Trusted(g.assistant_to_user + turn[0].text)
        else:
            turn.insert(0, Trusted(g.assistant_to_user))
        if isinstance(turn[-1], Trusted):
            turn[-1] = Trusted(turn[-1].text + g.assistant_start)
        else:
            turn.append(Trusted(g.assistant_start))
        return self._build(b, [*self._answer(b), Tokens(tuple(d.tokens)), *turn])

    def retrieval_prompt(self, b: Branch) -> list[int]:
        g = self._glue
        so_far = f"Answer so far: {b.prefix}\n" if b.prefix else ""
        text = self._q.retrieve.format(question="\x00", answer_so_far="\x00")
        before, middle, after = text.split("\x00")
        parts = [*system_head(g), Trusted(before), Untrusted(b.question), Trusted(middle)]
        if so_far:
            parts.append(Untrusted(so_far))
        parts += [Trusted(after + g.assistant_start)]
        return self._builder.build(parts)

    def relevance_prompt(self, b: Branch) -> tuple[list[int], int]:
        return self._build(
            b, [*self._user(b, self._q.relevance), Trusted(self._glue.assistant_start)]
        )

    def draft_prompt(self, b: Branch) -> tuple[list[int], int]:
        return self._build(b, self._answer(b))

    def support_prompt(self, b: Branch, d: Generation) -> tuple[list[int], int]:
        return self._follow_up(b, d, self._q.support)

    def utility_prompt(self, b: Branch, d: Generation) -> tuple[list[int], int]:
        # IsUse judges the answer against the question alone, (x, y_t): no passage in view.
        return self._follow_up(replace(b, passage=None), d, self._q.utility)

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        prompts = [self.retrieval_prompt(b) for b in branches]
        return self._read("retrieve", prompts, [0] * len(prompts))

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        built = [self.relevance_prompt(b) for b in branches]
        return self._read("relevance", [p for p, _ in built], [n for _, n in built])

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        requests = []
        for b in branches:
            prompt, reusable = self.draft_prompt(b)
            requests.append(
                GenerationRequest(
                    prompt,
                    max_tokens,
                    self._stop_tokens(),
                    reusable_prefix=reusable,
                    sampling=b.sampling,
                    min_tokens=b.min_tokens,
                )
            )
        return self._model.generate(requests) if requests else []

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        built = [self.support_prompt(b, d) for b, d in zip(branches, drafts, strict=True)]
        return self._read("support", [p for p, _ in built], [n for _, n in built])

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        built = [self.utility_prompt(b, d) for b, d in zip(branches, drafts, strict=True)]
        return self._read("utility", [p for p, _ in built], [n for _, n in built])


class SequenceCritic(ChatCritic):
    """The chat layout as one growing sequence per branch (the learned and native-chat
    critique).

    A branch's reads lie on the sequence it drafts on, [system, user(passage, question, task),
    assistant(answer so far)], or fork from it: p_ret at the end of the closed-book one (where
    the no-retrieval branch goes on drafting); s_rel after its own short question, on a fork
    that shares "template + passage + question" with the drafting sequence (read where the
    segment starts, s_rel separated relevant from irrelevant passages far worse: validation AUC
    0.74 against 0.91 with Qwen2.5-Coder-0.5B, 0.66 against 0.82 with SmolLM2); then the
    segment; then one short cue after which s_sup and s_use are read from the same position.
    Each prompt extends what the engine's slots already hold, so no token is prefilled twice
    (`prompted` keeps a question per group and utility without the passage: the slower
    layout)."""

    def retrieval_prompt(self, b: Branch) -> list[int]:
        return self.draft_prompt(replace(b, passage=None))[0]

    def support_prompt(self, b: Branch, d: Generation) -> tuple[list[int], int]:
        return self._follow_up(b, d, self._q.critique)

    def utility_prompt(self, b: Branch, d: Generation) -> tuple[list[int], int]:
        return self.support_prompt(b, d)
