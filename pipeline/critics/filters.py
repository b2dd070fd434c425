"""The settling of a request's hard filters: calibrated on the served corpus, else off.

No source has constant defaults: a threshold chosen on one corpus pruned every passage of
answerable questions on another (s_rel and s_sup move between corpora). The draft budget
(`max_drafts`) keeps one evidence branch a step: the retriever's first, unless the critique
reads another far more relevant (`draft_order_margin`).
"""

from __future__ import annotations

from collections.abc import Mapping

from selfrag.schemas.decoding import DecodingConfig

# The filters a request may leave unset (None), with the value they take without a default.
FILTERS_OFF: dict[str, object] = {
    "min_relevance": 0.0,
    "relevance_margin": 1.0,
    "min_support": "none",
    "min_support_score": 0.0,
    "min_support_score_by_corpus": {},
}


def settle_filters(
    config: DecodingConfig, source: str, calibrated: Mapping[str, object] | None = None
) -> DecodingConfig:
    """`config` settled for the concrete critique `source` (not `auto`): its critique set to
    `source`, and each filter it leaves unset (None) filled with what was calibrated on the
    served corpus for this model and source (`calibrated`), else off (`FILTERS_OFF`). Filters
    the request set stay as they are; a `min_support_score` it set applies to every
    corpus, unless it set `min_support_score_by_corpus` too."""
    defaults = {**FILTERS_OFF, **(calibrated or {})}
    if config.min_support_score is not None:
        defaults["min_support_score_by_corpus"] = {}
    update: dict[str, object] = {
        name: defaults[name] for name in FILTERS_OFF if getattr(config, name) is None
    }
    if config.critique != source:
        update["critique"] = source
    return config.model_copy(update=update) if update else config


def unsettled_filters(config: DecodingConfig) -> list[str]:
    """The filters `config` still leaves unset (None): it was not settled (`settle_filters`)."""
    return [name for name in FILTERS_OFF if getattr(config, name) is None]
