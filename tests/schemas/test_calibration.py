"""schemas/calibration.py: the logistic map is safe at the extremes and for NaN, parameters are
bounded and frozen, and the calibration files' types refuse what they do not know."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from selfrag.schemas.calibration import CalibrationSettings, LogisticParams


def test_the_probability_is_the_logistic_of_a_x_plus_b():
    params = LogisticParams(a=2.0, b=-1.0)
    assert params.probability(0.5) == 0.5
    assert params.probability(1.0) == pytest.approx(1.0 / (1.0 + math.exp(-1.0)))
    assert params.probability(0.0) == pytest.approx(1.0 - params.probability(1.0))


def test_the_probability_does_not_overflow_and_a_nan_signal_is_a_coin_flip():
    params = LogisticParams(a=1000.0, b=0.0)
    assert params.probability(1e6) == 1.0
    assert params.probability(-1e6) == 0.0
    assert params.probability(math.nan) == 0.5


def test_parameters_are_bounded_frozen_and_strict():
    with pytest.raises(ValidationError):
        LogisticParams(a=1001.0)
    with pytest.raises(ValidationError):
        LogisticParams(a=1.0, c=2.0)  # type: ignore[call-arg]
    params = LogisticParams()
    with pytest.raises(ValidationError):
        params.a = 3.0  # type: ignore[misc]


def test_the_default_signals_map_higher_gains_to_higher_relevance():
    settings = CalibrationSettings()
    assert settings.relevance.probability(2.0) > settings.relevance.probability(-2.0)
    assert 0.0 < settings.retrieval.probability(-1.0) < 1.0
    assert CalibrationSettings.model_validate(settings.model_dump()) == settings
    with pytest.raises(ValidationError):
        CalibrationSettings(relevance={"a": 1.0}, typo=1)  # type: ignore[call-arg]
