"""pipeline/critics/filters.py: a request's unset filters are filled from the calibration, else
off; what the request set is kept; the critique is the concrete source."""

from __future__ import annotations

from selfrag.pipeline.critics.filters import FILTERS_OFF, settle_filters, unsettled_filters
from selfrag.schemas.decoding import DecodingConfig


def test_an_unset_config_settles_to_every_filter_off_without_a_calibration():
    settled = settle_filters(DecodingConfig(), "likelihood")
    assert settled.critique == "likelihood"
    assert {name: getattr(settled, name) for name in FILTERS_OFF} == FILTERS_OFF
    assert unsettled_filters(settled) == []


def test_calibrated_values_fill_only_the_filters_the_request_left_unset():
    config = DecodingConfig(min_relevance=0.7, critique="learned")
    settled = settle_filters(config, "learned", {"min_relevance": 0.2, "min_support_score": 0.35})
    assert settled.min_relevance == 0.7  # the request's own value wins
    assert settled.min_support_score == 0.35  # calibrated
    assert settled.relevance_margin == FILTERS_OFF["relevance_margin"]  # neither: off
    assert settled.min_support == FILTERS_OFF["min_support"]


def test_auto_becomes_the_concrete_source():
    assert settle_filters(DecodingConfig(critique="auto"), "native").critique == "native"


def test_a_settled_config_is_returned_as_it_is():
    settled = settle_filters(DecodingConfig(), "prompted", {"min_relevance": 0.4})
    assert settle_filters(settled, "prompted", {"min_relevance": 0.9}) is settled


def test_unsettled_filters_names_each_filter_left_unset_in_order():
    config = DecodingConfig(relevance_margin=0.3, min_support="partial")
    assert unsettled_filters(config) == ["min_relevance", "min_support_score"]
    assert unsettled_filters(DecodingConfig()) == list(FILTERS_OFF)


def test_the_request_is_not_changed_by_settling_it():
    config = DecodingConfig()
    settle_filters(config, "learned", {"min_support_score": 0.5})
    assert config.min_support_score is None and config.critique == "auto"
