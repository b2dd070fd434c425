import math

import pytest

from selfrag.pipeline.scoring import (
    CritiqueWeights,
    most_likely,
    relevance_score,
    retrieval_probability,
    segment_score,
    should_retrieve,
    support_score,
    utility_score,
)


def test_retrieval_probability_normalises_yes_over_yes_and_no():
    assert retrieval_probability({"yes": 0.3, "no": 0.1, "continue": 0.6}) == pytest.approx(0.75)


def test_retrieval_probability_missing_tokens_are_zero_not_nan():
    assert retrieval_probability({"yes": 0.2}) == pytest.approx(1.0)
    assert retrieval_probability({}) == 0.5
    assert not math.isnan(retrieval_probability({"yes": float("nan"), "no": 0.4}))


def test_should_retrieve_is_strictly_greater_than_threshold():
    assert should_retrieve(0.51, 0.5)
    assert not should_retrieve(0.5, 0.5)


def test_relevance_score():
    assert relevance_score({"relevant": 0.6, "irrelevant": 0.2}) == pytest.approx(0.75)
    assert relevance_score({"irrelevant": 0.2}) == 0.0
    assert relevance_score({}) == 0.5


def test_support_score_formula():
    probs = {"full": 0.2, "partial": 0.4, "none": 0.2}
    assert support_score(probs) == pytest.approx((0.2 + 0.5 * 0.4) / 0.8)
    assert support_score({"partial": 1.0}) == pytest.approx(0.5)
    assert support_score({}) == 0.0


def test_utility_score_weights():
    assert utility_score({"5": 1.0}) == pytest.approx(1.0)
    assert utility_score({"1": 1.0}) == pytest.approx(-1.0)
    assert utility_score({"3": 0.5}) == pytest.approx(0.0)
    probs = {"1": 0.1, "2": 0.1, "3": 0.2, "4": 0.2, "5": 0.2}
    expected = (-1 * 0.1 - 0.5 * 0.1 + 0 + 0.5 * 0.2 + 1 * 0.2) / 0.8
    assert utility_score(probs) == pytest.approx(expected)
    assert utility_score({}) == 0.0


def test_worked_example_from_the_issue():
    w = CritiqueWeights(w_rel=1.0, w_sup=1.0, w_use=0.5)
    a = segment_score(-0.90, s_rel=0.95, s_sup=0.40, s_use=0.80, weights=w)
    b = segment_score(-1.30, s_rel=0.80, s_sup=0.95, s_use=0.60, weights=w)
    assert a == pytest.approx(0.85)
    assert b == pytest.approx(0.75)
    assert a > b
    w2 = CritiqueWeights(w_rel=1.0, w_sup=2.0, w_use=0.5)
    a2 = segment_score(-0.90, s_rel=0.95, s_sup=0.40, s_use=0.80, weights=w2)
    b2 = segment_score(-1.30, s_rel=0.80, s_sup=0.95, s_use=0.60, weights=w2)
    assert a2 == pytest.approx(1.25)
    assert b2 == pytest.approx(1.70)
    assert b2 > a2


def test_segment_score_length_normalised_and_missing_critique():
    w = CritiqueWeights(1.0, 1.0, 1.0)
    assert segment_score(-4.0, s_rel=None, s_sup=None, s_use=None, weights=w) == -4.0
    assert segment_score(
        -4.0, s_rel=None, s_sup=None, s_use=0.5, weights=w, n_tokens=8, length_normalize=True
    ) == pytest.approx(-0.5 + 0.5)


def test_most_likely_breaks_ties_by_order():
    assert (
        most_likely({"full": 0.2, "partial": 0.5, "none": 0.3}, ("full", "partial", "none"))
        == "partial"
    )
    assert most_likely({}, ("full", "partial", "none")) == "full"


def test_evidence_support_weighs_s_sup_by_similarity_clamped():
    from selfrag.pipeline.scoring import evidence_support

    assert evidence_support(0.8, 0.5) == pytest.approx(0.4)
    assert evidence_support(0.8, None) == pytest.approx(0.8)
    assert evidence_support(0.8, float("nan")) == pytest.approx(0.8)
    assert evidence_support(0.8, -0.2) == 0.0
    assert evidence_support(0.8, 1.3) == pytest.approx(0.8)
