"""Fitting the logistic calibration of the likelihood critique."""

from __future__ import annotations

import math
import random

import pytest

from selfrag.infra.settings_loader import load_settings
from selfrag.jobs.calibrate import fit_samples, write_calibration
from selfrag.pipeline.learning.logistic_fit import auc, fit_logistic
from selfrag.schemas.calibration import CalibrationSettings, LogisticParams


def _synthetic(a: float, b: float, n: int, seed: int) -> tuple[list[float], list[bool]]:
    rng = random.Random(seed)
    xs = [rng.uniform(-3.0, 3.0) for _ in range(n)]
    ys = [rng.random() < 1.0 / (1.0 + math.exp(-(a * x + b))) for x in xs]
    return xs, ys


@pytest.mark.parametrize(("a", "b"), [(2.0, -1.0), (-1.5, 0.5), (0.7, 1.2)])
def test_fit_recovers_known_parameters(a: float, b: float):
    xs, ys = _synthetic(a, b, 4000, seed=int(10 * a))
    fit = fit_logistic(xs, ys)
    assert fit.a == pytest.approx(a, abs=0.25)
    assert fit.b == pytest.approx(b, abs=0.25)


def test_separable_and_one_class_data_stay_finite():
    fit = fit_logistic([-2.0, -1.0, 1.0, 2.0], [False, False, True, True])
    assert math.isfinite(fit.a) and fit.a > 0 and abs(fit.b) < 1.0
    flat = fit_logistic([0.1, 0.2, 0.3], [True, True, True])
    assert flat.a == 0.0 and flat.probability(5.0) > 0.5
    with pytest.raises(ValueError):
        fit_logistic([], [])
    with pytest.raises(ValueError):
        fit_logistic([1.0], [True, False])


def test_auc():
    assert auc([1, 2, 3, 4], [0, 0, 1, 1]) == 1.0
    assert auc([1, 1], [0, 1]) == 0.5
    assert auc([1, 2], [1, 1]) is None


def test_probability_is_safe_for_large_inputs():
    p = LogisticParams(a=1000.0, b=0.0)
    assert p.probability(10.0) == 1.0 and p.probability(-10.0) == 0.0
    assert p.probability(float("nan")) == 0.5


def test_fitted_calibration_round_trips_through_the_home(tmp_path):
    xs, ys = _synthetic(3.0, -0.5, 500, seed=1)
    samples = [{"signal": "relevance", "x": x, "y": y} for x, y in zip(xs, ys, strict=True)]
    cal, stats = fit_samples(samples, "synthetic")
    assert stats["relevance"]["n"] == 500 and stats["support"]["n"] == 0
    assert cal.support == CalibrationSettings().support  # no samples: default kept
    (tmp_path / "calibration.toml").write_text("# an earlier calibration\n")
    path = write_calibration(tmp_path, cal)  # replaced in one rename, readable by a server
    assert path == tmp_path / "calibration.toml" and path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.toml"]
    loaded = load_settings(environ={"SELFRAG_HOME": str(tmp_path)}).calibration
    assert loaded == cal
    assert loaded.fitted_on == "synthetic"
    # `--home` arrives as an override, not through the environment: same file.
    via_flag = load_settings(environ={}, overrides={"home": str(tmp_path)}).calibration
    assert via_flag == cal
