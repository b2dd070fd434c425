"""`make_critic`: the critique source a name (or `auto`) stands for, on a given model."""

from __future__ import annotations

from selfrag.pipeline.answerability_model import AnswerabilityModel
from selfrag.pipeline.critics.answerability import AnswerabilityCritic
from selfrag.pipeline.critics.base import NATIVE_CHAT_LAYOUT, NATIVE_EARLIER_LAYOUTS, Critic
from selfrag.pipeline.critics.learned import LearnedCritic
from selfrag.pipeline.critics.likelihood import LikelihoodCritic
from selfrag.pipeline.critics.native import (
    NativeChatCritic,
    NativeCritic,
    native_token_ids,
)
from selfrag.pipeline.critics.prompted import PromptedCritic
from selfrag.pipeline.heads import ReflectionHeads
from selfrag.pipeline.protocols import LanguageModel
from selfrag.schemas.calibration import CalibrationSettings


class CritiqueUnavailable(ValueError):
    """The critique source asked for cannot run on this model (no reflection tokens, no
    reflection heads, or no such source): the request's choice, not the deployment's fault."""


def auto_source(*, native: bool, learned: bool) -> str:
    """The source `auto` stands for on a model: native when its vocabulary has the reflection
    tokens, else learned when it has reflection heads (`learned`), else likelihood."""
    if native:
        return "native"
    return "learned" if learned else "likelihood"


def make_critic(
    model: LanguageModel,
    source: str,
    calibration: CalibrationSettings | None = None,
    heads: ReflectionHeads | None = None,
    answerability: AnswerabilityModel | None = None,
) -> Critic:
    """`source_critic`, with its s_sup from `answerability` (`AnswerabilityCritic`) when that
    model was fitted on the source `source` resolves to; the source alone otherwise. The
    caller checks that `answerability` belongs to this model file (`AnswerabilityModel.check`).
    """
    return with_answerability(
        source_critic(model, source, calibration, heads), model, answerability
    )


def with_answerability(
    critic: Critic, model: LanguageModel, answerability: AnswerabilityModel | None
) -> Critic:
    """`critic` with its s_sup from `answerability` when that was fitted on this source."""
    if answerability is not None and answerability.source == critic.name:
        return AnswerabilityCritic(critic, model, answerability)
    return critic


def source_critic(
    model: LanguageModel,
    source: str,
    calibration: CalibrationSettings | None = None,
    heads: ReflectionHeads | None = None,
) -> Critic:
    """Build the critique source named by `source`.

    auto: native when the model has the reflection tokens, else learned when `heads` were
    trained for this model file, else likelihood (on the Normans tuning questions it ranked
    evidence far better than prompted yes/no questions with SmolLM2, notes/evaluation.md).

    `calibration` parameterises the `likelihood` source (defaults when None); `heads` are the
    reflection heads of this model file (`selfrag train`), or None.
    """
    if source == "likelihood":
        return LikelihoodCritic(model, calibration)
    if source == "prompted":
        return PromptedCritic(model)
    if source == "learned":
        if heads is None:
            raise CritiqueUnavailable(
                "critique 'learned' needs reflection heads for this model file; train them "
                "with `selfrag train`"
            )
        return LearnedCritic(model, heads)
    if source not in ("native", "auto"):
        raise CritiqueUnavailable(f"unknown critique source {source!r}")
    groups = native_token_ids(model)
    if groups is not None:
        if model.special_token_id(NATIVE_CHAT_LAYOUT) is not None:
            return NativeChatCritic(model, groups)
        if any(model.special_token_id(t) is not None for t in NATIVE_EARLIER_LAYOUTS):
            raise CritiqueUnavailable(
                "this model's reflection tokens were exported for the read positions of an "
                "earlier selfrag; export it again with `selfrag train --export-gguf`"
            )
        return NativeCritic(model, groups)
    if source == "native":
        raise CritiqueUnavailable(
            "critique 'native' needs a Self-RAG checkpoint; this model's vocabulary has no "
            "reflection tokens (use 'learned', 'likelihood' or 'prompted')"
        )
    learned = heads is not None and model.hidden_size is not None
    if auto_source(native=False, learned=learned) == "learned":
        assert heads is not None
        return LearnedCritic(model, heads)
    return LikelihoodCritic(model, calibration)
