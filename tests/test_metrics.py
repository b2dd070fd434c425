"""Evaluation metrics: SQuAD normalisation, accuracy, token F1, abstention and the report row."""

from __future__ import annotations

import pytest

from selfrag.pipeline.metrics import (
    Outcome,
    best_f1,
    contains_answer,
    normalize_answer,
    percentile,
    summarize,
    token_f1,
)


def _o(
    answerable: bool,
    answer: str,
    *,
    golds=("France",),
    abstained=False,
    s_sup=None,
    cited=(),
    retrieved=True,
    ms=100.0,
    prefill=10,
) -> Outcome:
    return Outcome(
        answerable,
        tuple(golds) if answerable else (),
        answer,
        abstained,
        retrieved,
        s_sup,
        tuple(cited),
        ms,
        prefill,
    )


def test_normalisation_follows_squad():
    assert normalize_answer("The  Normans, of France!") == "normans of france"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("") == ""


def test_contains_answer_on_word_boundaries():
    assert contains_answer("It is located in France.", ["france"])
    assert contains_answer("In the 10th and 11th centuries", ["10th and 11th centuries"])
    assert not contains_answer("in 10666", ["1066"])
    assert not contains_answer("anything", [""])
    assert not contains_answer("anything", [])


def test_token_f1():
    assert token_f1("the cat sat", "cat sat") == 1.0
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("cat dog", "cat") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert best_f1("William the Conqueror", ["Harold", "William the Conqueror"]) == 1.0
    assert best_f1("x", []) == 0.0


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_summary_splits_answerable_and_unanswerable():
    rows = [
        _o(True, "It is France.", s_sup=0.9, cited=(True,)),
        _o(True, "It is Spain.", s_sup=0.3, cited=(False,)),
        _o(True, "", abstained=True),
        _o(False, "Rollo", s_sup=0.8),  # confidently wrong
        _o(False, "Rollo", s_sup=0.2),  # answered, low support: not confident
        _o(False, "", abstained=True, retrieved=False),
    ]
    s = summarize(rows)
    assert s["accuracy"] == pytest.approx(1 / 3)
    assert s["abstain_rate"] == pytest.approx(1 / 3)
    assert s["wrong_confident_rate"] == pytest.approx(1 / 3)
    assert s["overall"] == pytest.approx(2 / 6)
    assert s["citation_precision"] == pytest.approx(0.5)
    assert s["s_sup_correct"] == pytest.approx(0.9)
    assert s["s_sup_wrong"] == pytest.approx(0.3)
    assert s["retrieval_rate"] == pytest.approx(5 / 6)
    assert s["p50_ms"] == 100.0 and s["prefill_tokens"] == 10.0


def test_answer_without_support_score_counts_as_confident():
    s = summarize([_o(False, "Rollo")])
    assert s["wrong_confident_rate"] == 1.0 and s["accuracy"] is None and s["s_sup_wrong"] is None


def test_support_auc_ranks_right_answers_above_wrong_ones_and_pruned_rate():
    from dataclasses import replace

    outcomes = [
        _o(True, "It is France.", s_sup=0.9),  # right
        _o(True, "It is Spain.", s_sup=0.2),  # wrong
        _o(False, "Maybe Spain.", s_sup=0.4),  # answered an unanswerable question: wrong
        _o(False, "", abstained=True, s_sup=0.95),  # abstained: not ranked
    ]
    outcomes = [
        replace(o, evidence_branches=3, branches_pruned=i % 2) for i, o in enumerate(outcomes)
    ]
    row = summarize(outcomes)
    assert row["s_sup_auc"] == pytest.approx(1.0)
    assert row["pruned_rate"] == pytest.approx(2 / 12)
    flipped = [replace(o, s_sup=1.0 - o.s_sup) for o in outcomes]
    assert summarize(flipped)["s_sup_auc"] == pytest.approx(0.0)
    assert summarize([_o(True, "France")])["pruned_rate"] is None
