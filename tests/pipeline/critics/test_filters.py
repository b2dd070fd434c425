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
    assert unsettled_filters(config) == [
        "min_relevance",
        "min_support_score",
        "min_support_score_by_corpus",
    ]
    assert unsettled_filters(DecodingConfig()) == list(FILTERS_OFF)


def test_the_request_is_not_changed_by_settling_it():
    config = DecodingConfig()
    settle_filters(config, "learned", {"min_support_score": 0.5})
    assert config.min_support_score is None and config.critique == "auto"


CALIBRATED = {"min_support_score": 0.15, "min_support_score_by_corpus": {"squad": 0.21}}


def test_each_collection_takes_its_own_calibrated_threshold_when_the_request_sets_none():
    settled = settle_filters(DecodingConfig(), "learned", CALIBRATED)
    assert settled.min_support_score_by_corpus == {"squad": 0.21}
    assert settled.support_threshold("squad") == 0.21
    assert settled.support_threshold("wiki") == 0.15  # no threshold of its own: the lowest
    assert settled.support_threshold(None) == 0.15


def test_a_requested_support_threshold_holds_every_collection():
    settled = settle_filters(DecodingConfig(min_support_score=0.3), "learned", CALIBRATED)
    assert settled.min_support_score_by_corpus == {}
    assert settled.support_threshold("squad") == 0.3


def test_requested_thresholds_per_collection_are_kept():
    config = DecodingConfig(min_support_score=0.3, min_support_score_by_corpus={"a": 0.1})
    settled = settle_filters(config, "learned", CALIBRATED)
    assert settled.support_threshold("a") == 0.1
    assert settled.support_threshold("squad") == 0.3
    config = DecodingConfig(min_support_score_by_corpus={"a": 0.1})
    settled = settle_filters(config, "learned", CALIBRATED)
    assert settled.support_threshold("a") == 0.1
    assert settled.support_threshold("squad") == 0.15  # calibrated for all, not per collection
