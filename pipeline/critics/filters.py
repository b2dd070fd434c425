"""Hard-filter defaults per critique source, and their resolution in a request's config."""

from __future__ import annotations

from collections.abc import Mapping

from selfrag.schemas.decoding import DecodingConfig

# The filters a request may leave unset (None), with the value they take without a default.
FILTERS_OFF: dict[str, object] = {
    "min_relevance": 0.0,
    "relevance_margin": 1.0,
    "min_support": "none",
    "min_support_score": 0.0,
}
# A critique source's own filter defaults, by name. Only the learned heads earn any: chosen on
# the Normans questions (docs/evaluation.md). Its min_support_score applies only where no
# threshold was calibrated on the served corpus (`selfrag calibrate`): s_sup's scale moves
# between corpora. The margin is relative to the best passage, so it
# holds where the head's scale shifts between articles, as its absolute scores do.
CRITIQUE_FILTERS: dict[str, dict[str, object]] = {
    "learned": {"min_relevance": 0.5, "relevance_margin": 0.2, "min_support_score": 0.36},
}


def filter_defaults(
    critique: str, calibrated: Mapping[str, object] | None = None
) -> dict[str, object]:
    """The value each filter takes when a request leaves it unset, in this order: what was
    calibrated on the served corpus for this model and source (`calibrated`, e.g. its
    `min_support_score`), else the source's constant default, else off."""
    return {**FILTERS_OFF, **CRITIQUE_FILTERS.get(critique, {}), **(calibrated or {})}


def resolve_filters(
    config: DecodingConfig, critique: str, calibrated: Mapping[str, object] | None = None
) -> DecodingConfig:
    """`config` with unset filters (None) replaced by `filter_defaults`."""
    defaults = filter_defaults(critique, calibrated)
    unset = {name: defaults[name] for name in FILTERS_OFF if getattr(config, name) is None}
    return config.model_copy(update=unset) if unset else config


def unresolved_filters(
    config: DecodingConfig, critique: str, calibrated: Mapping[str, object] | None = None
) -> DecodingConfig:
    """The inverse of `resolve_filters`: filters equal to the default back to None (a
    response's config, as the request that asked for the defaults would have it)."""
    defaults = filter_defaults(critique, calibrated)
    same = {name: None for name in FILTERS_OFF if getattr(config, name) == defaults[name]}
    return config.model_copy(update=same) if same else config
