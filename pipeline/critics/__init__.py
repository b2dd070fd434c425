"""Critique sources: where the reflection probabilities come from, one module per source.

Every source answers the same five questions for a batch of branches — should we retrieve, is
this passage relevant, draft a segment, is the segment supported, how useful is it — and
returns label probabilities that `pipeline.scoring` turns into p_ret, s_rel, s_sup and s_use.

* `native`: the reflection tokens of a Self-RAG checkpoint (`NativeCritic`, `NativeChatCritic`).
* `prompted`: any instruct model's answer tokens under short questions (`PromptedCritic`).
* `likelihood`: likelihood gains of the generator itself (`LikelihoodCritic`).
* `learned`: reflection heads on the final hidden state (`LearnedCritic`).

`AnswerabilityCritic` wraps any of them, replacing s_sup by `pipeline.answerability_model`'s p.
"""

from selfrag.pipeline.critics.answerability import (
    AnswerabilityCritic,
    RelevanceReading,
    read_relevance,
    read_support,
)
from selfrag.pipeline.critics.base import (
    NATIVE_CHAT_LAYOUT,
    NATIVE_EARLIER_LAYOUTS,
    NATIVE_MARKUP,
    NATIVE_TOKENS,
    READ_LAYOUT,
    RELEVANCE_LABELS,
    RESERVED_PIECES,
    RETRIEVE_LABELS,
    SUPPORT_LABELS,
    UTILITY_LABELS,
    Branch,
    Critic,
    LabelProbs,
    LabelTokens,
    read_groups,
    read_requests,
)
from selfrag.pipeline.critics.chat import ChatCritic, PromptedQuestions, SequenceCritic
from selfrag.pipeline.critics.factory import (
    CritiqueUnavailable,
    make_critic,
    source_critic,
    with_answerability,
)
from selfrag.pipeline.critics.filters import (
    FILTERS_OFF,
    settle_filters,
    unsettled_filters,
)
from selfrag.pipeline.critics.learned import LearnedCritic
from selfrag.pipeline.critics.likelihood import LikelihoodCritic
from selfrag.pipeline.critics.native import NativeChatCritic, NativeCritic, native_token_ids
from selfrag.pipeline.critics.prompted import PromptedCritic, first_token_labels

__all__ = [
    "FILTERS_OFF",
    "NATIVE_CHAT_LAYOUT",
    "NATIVE_EARLIER_LAYOUTS",
    "NATIVE_MARKUP",
    "NATIVE_TOKENS",
    "READ_LAYOUT",
    "RELEVANCE_LABELS",
    "RESERVED_PIECES",
    "RETRIEVE_LABELS",
    "SUPPORT_LABELS",
    "UTILITY_LABELS",
    "AnswerabilityCritic",
    "Branch",
    "ChatCritic",
    "Critic",
    "CritiqueUnavailable",
    "LabelProbs",
    "LabelTokens",
    "LearnedCritic",
    "LikelihoodCritic",
    "NativeChatCritic",
    "NativeCritic",
    "PromptedCritic",
    "PromptedQuestions",
    "RelevanceReading",
    "SequenceCritic",
    "first_token_labels",
    "make_critic",
    "native_token_ids",
    "read_groups",
    "read_relevance",
    "read_requests",
    "read_support",
    "settle_filters",
    "source_critic",
    "unsettled_filters",
    "with_answerability",
]
