"""Critique sources: where the reflection probabilities come from.

Every source answers the same five questions for a batch of branches — should we retrieve,
is this passage relevant, draft a segment, is the segment supported, how useful is it — and
returns label probabilities that `pipeline.scoring` turns into p_ret, s_rel, s_sup and s_use.

* `NativeCritic` reads the reflection tokens of a trained Self-RAG checkpoint.
* `PromptedCritic` asks any instruct model short questions and reads its answer tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from pipeline.heads import HeadsError, ReflectionHeads
from pipeline.prompts import ChatGlue, Part, PromptBuilder, Tokens, Trusted, Untrusted, chat_glue
from pipeline.protocols import (
    Generation,
    GenerationRequest,
    LanguageModel,
    Passage,
    TokenScoreRequest,
)
from schemas.calibration import CalibrationSettings
from schemas.decoding import DecodingConfig

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


@dataclass(frozen=True)
class LabelProbs:
    """Probabilities of a reflection group's labels, and the prompt tokens it cost."""

    probs: dict[str, float]
    prefill_tokens: int


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


def _read_groups(
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


# --- native Self-RAG checkpoints ----------------------------------------------------------------

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
# A control token in the vocabulary of a model exported by `selfrag train --export-gguf`: its
# reflection rows were trained at the positions of the chat layout (`ChatCritic`), not of the
# Asai et al. prompt format.
NATIVE_CHAT_LAYOUT = "<|reflection_layout:chat|>"


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
        reserved = [p for labels in NATIVE_TOKENS.values() for p in labels.values()]
        self._builder = PromptBuilder(model, reserved=[*reserved, *NATIVE_MARKUP])
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
            Untrusted(_passage_text(b.passage)),
            Trusted("</paragraph>"),
        ]

    def _draft_parts(self, b: Branch) -> list[Part]:
        if b.passage is None:
            return [*self._head(b), Trusted("[No Retrieval]")]
        return [*self._evidence(b), Trusted("[Relevant]")]

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        prompts = [self._builder.build(self._head(b)) for b in branches]
        return _read_groups(self._model, prompts, self._groups["retrieve"])

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        prompts = [self._builder.build(self._evidence(b)) for b in branches]
        return _read_groups(self._model, prompts, self._groups["relevance"])

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        requests = [
            GenerationRequest(self._builder.build(self._draft_parts(b)), max_tokens, self._stops)
            for b in branches
        ]
        return self._model.generate(requests) if requests else []

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        prompts = [
            self._builder.build([*self._draft_parts(b), Tokens(tuple(d.tokens))])
            for b, d in zip(branches, drafts, strict=True)
        ]
        return _read_groups(self._model, prompts, self._groups["support"])

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        # Self-RAG emits [Utility:k] at the end of the response, after the support token.
        sup = self._groups["support"].ids["full"]
        prompts = [
            self._builder.build([*self._draft_parts(b), Tokens(tuple(d.tokens))])
            + ([] if b.passage is None else list(sup))
            for b, d in zip(branches, drafts, strict=True)
        ]
        return _read_groups(self._model, prompts, self._groups["utility"])


def _passage_text(p: Passage) -> str:
    return f"{p.title}\n{p.text}" if p.title else p.text


# --- any instruct model ---------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "You answer questions accurately and briefly, using the given evidence when there is some."
)


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
        self._builder = PromptBuilder(
            model, reserved=[p for g in NATIVE_TOKENS.values() for p in g.values()]
        )

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
        g = self._glue
        parts: list[Part] = [Trusted(g.start)]
        if g.has_system:
            parts += [Trusted(SYSTEM_PROMPT), Trusted(g.system_to_user)]
        if b.passage is not None:
            parts += [Trusted("Passage: "), Untrusted(_passage_text(b.passage)), Trusted("\n\n")]
        return parts

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
        g = self._glue
        return self._build(
            b,
            [
                *self._answer(b),
                Tokens(tuple(d.tokens)),
                Trusted(g.assistant_to_user + question + g.assistant_start),
            ],
        )

    def retrieval_prompt(self, b: Branch) -> list[int]:
        g = self._glue
        so_far = f"Answer so far: {b.prefix}\n" if b.prefix else ""
        text = self._q.retrieve.format(question="\x00", answer_so_far="\x00")
        before, middle, after = text.split("\x00")
        parts: list[Part] = [Trusted(g.start)]
        if g.has_system:
            parts += [Trusted(SYSTEM_PROMPT), Trusted(g.system_to_user)]
        parts += [Trusted(before), Untrusted(b.question), Trusted(middle)]
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
                GenerationRequest(prompt, max_tokens, self._stop_tokens(), reusable_prefix=reusable)
            )
        return self._model.generate(requests) if requests else []

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        built = [self.support_prompt(b, d) for b, d in zip(branches, drafts, strict=True)]
        return self._read("support", [p for p, _ in built], [n for _, n in built])

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        built = [self.utility_prompt(b, d) for b, d in zip(branches, drafts, strict=True)]
        return self._read("utility", [p for p, _ in built], [n for _, n in built])


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
        return _read_groups(self._model, prompts, self._labels[group], reusable)


class NativeChatCritic(ChatCritic):
    """Reflection tokens of a model exported by `selfrag train --export-gguf`: the chat layout
    (declared by the vocabulary token `NATIVE_CHAT_LAYOUT`), read through the output matrix."""

    name = "native"

    def __init__(self, model: LanguageModel, groups: dict[str, LabelTokens]) -> None:
        super().__init__(model)
        self._groups = groups

    def _read(
        self, group: str, prompts: Sequence[list[int]], reusable: Sequence[int]
    ) -> list[LabelProbs]:
        # Asked with the hidden state (unused) so that the engine decodes exactly as for the
        # learned reads these rows came from: other batch shapes differ by ~1e-2 nats.
        return _read_groups(
            self._model,
            prompts,
            self._groups[group],
            reusable,
            hidden_state=self._model.hidden_size is not None,
        )

    def _stop_tokens(self) -> frozenset[int]:
        return frozenset(t for g in self._groups.values() for t in g.candidates)


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


# The filters a request may leave unset (None), with the value they take without a default.
FILTERS_OFF: dict[str, object] = {
    "min_relevance": 0.0,
    "min_support": "none",
    "min_support_score": 0.0,
}
# A critique source's own filter defaults, by name. Only the learned heads earn any: chosen on
# the Normans questions (docs/evaluation.md).
CRITIQUE_FILTERS: dict[str, dict[str, object]] = {
    "learned": {"min_relevance": 0.5, "min_support_score": 0.36},
}


def resolve_filters(config: DecodingConfig, critique: str) -> DecodingConfig:
    """`config` with unset filters (None) replaced by the defaults of the critique source."""
    defaults = {**FILTERS_OFF, **CRITIQUE_FILTERS.get(critique, {})}
    unset = {name: defaults[name] for name in FILTERS_OFF if getattr(config, name) is None}
    return config.model_copy(update=unset) if unset else config


def unresolved_filters(config: DecodingConfig, critique: str) -> DecodingConfig:
    """The inverse of `resolve_filters`: filters equal to the source's default back to None
    (a response's config, as the request that asked for the defaults would have it)."""
    defaults = {**FILTERS_OFF, **CRITIQUE_FILTERS.get(critique, {})}
    same = {name: None for name in FILTERS_OFF if getattr(config, name) == defaults[name]}
    return config.model_copy(update=same) if same else config


def read_requests(
    prompts: Sequence[list[int]], reusable: Sequence[int], *, hidden: bool
) -> list[TokenScoreRequest]:
    """The engine requests of a learned read: no candidate tokens, the hidden state or not."""
    return [
        TokenScoreRequest(prompt=p, candidates=(), reusable_prefix=n, hidden_state=hidden)
        for p, n in zip(prompts, reusable, strict=True)
    ]


def make_critic(
    model: LanguageModel,
    source: str,
    calibration: CalibrationSettings | None = None,
    heads: ReflectionHeads | None = None,
) -> Critic:
    """Build the critique source named by `source`.

    auto: native when the model has the reflection tokens, else learned when `heads` were
    trained for this model file, else likelihood (on the Normans tuning questions it ranked
    evidence far better than prompted yes/no questions with SmolLM2, docs/evaluation.md).

    `calibration` parameterises the `likelihood` source (defaults when None); `heads` are the
    reflection heads of this model file (`selfrag train`), or None.
    """
    from pipeline.likelihood import LikelihoodCritic  # imports this module

    if source == "likelihood":
        return LikelihoodCritic(model, calibration)
    if source == "prompted":
        return PromptedCritic(model)
    if source == "learned":
        if heads is None:
            raise ValueError(
                "critique 'learned' needs reflection heads for this model file; train them "
                "with `selfrag train`"
            )
        return LearnedCritic(model, heads)
    if source not in ("native", "auto"):
        raise ValueError(f"unknown critique source {source!r}")
    groups = native_token_ids(model)
    if groups is not None:
        if model.special_token_id(NATIVE_CHAT_LAYOUT) is not None:
            return NativeChatCritic(model, groups)
        return NativeCritic(model, groups)
    if source == "native":
        raise ValueError(
            "critique 'native' needs a Self-RAG checkpoint; this model's vocabulary has no "
            "reflection tokens (use 'learned', 'likelihood' or 'prompted')"
        )
    if heads is not None and model.hidden_size is not None:
        return LearnedCritic(model, heads)
    return LikelihoodCritic(model, calibration)
