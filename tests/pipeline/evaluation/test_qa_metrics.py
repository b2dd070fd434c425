"""Evaluation metrics: SQuAD normalisation, accuracy, token F1, abstention and the report row."""

from __future__ import annotations

import pytest

from selfrag.pipeline.evaluation.qa_metrics import (
    Outcome,
    PairedCounts,
    best_f1,
    contains_answer,
    normalize_answer,
    paired_counts,
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


def _scored(answerable: bool, score: float | None, *, right: bool = True, abstained=False):
    from dataclasses import replace

    answer = "" if abstained else ("It is France." if right else "It is Spain.")
    return replace(_o(answerable, answer, abstained=abstained), abstention_score=score)


def test_abstention_auroc_by_hand():
    from selfrag.pipeline.evaluation.qa_metrics import abstention_auroc

    rows = [_scored(True, s) for s in (0.9, 0.6, 0.4)] + [_scored(False, s) for s in (0.7, 0.2)]
    # Answerable above unanswerable in 4 of the 6 pairs: (0.9 > 0.7, 0.2), (0.6, 0.4 > 0.2).
    assert abstention_auroc(rows) == (pytest.approx(4 / 6), None)
    # Ties count half; a missing score ranks below every score and ties with another one.
    ties = [_scored(True, 0.5), _scored(True, 0.8), _scored(False, 0.5)]
    assert abstention_auroc(ties)[0] == pytest.approx((0.5 + 1) / 2)
    missing = [_scored(True, None), _scored(True, 0.3), _scored(False, None)]
    assert abstention_auroc(missing)[0] == pytest.approx((0.5 + 1) / 2)
    # The system's own abstentions keep their score (Self-RAG's support is known for them).
    assert abstention_auroc([_scored(True, 0.3), _scored(False, 0.1, abstained=True)])[0] == 1.0


def test_abstention_auroc_undefined_says_why():
    from selfrag.pipeline.evaluation.qa_metrics import abstention_auroc

    assert abstention_auroc([_scored(True, 0.5)]) == (None, "no unanswerable questions")
    assert abstention_auroc([_scored(False, 0.5)]) == (None, "no answerable questions")
    assert abstention_auroc([]) == (None, "no answerable questions")
    none = [_scored(True, None), _scored(False, None)]
    assert abstention_auroc(none) == (None, "no question has an abstention score")
    row = summarize([_scored(True, 0.5)])
    assert row["abstention_auroc"] is None
    assert row["abstention_auroc_reason"] == "no unanswerable questions"


def test_accuracy_coverage_curve_by_hand():
    from selfrag.pipeline.evaluation.qa_metrics import CoveragePoint, accuracy_coverage

    rows = [
        _scored(True, 0.9),
        _scored(True, 0.7, right=False),
        _scored(False, 0.8),  # an answered unanswerable question
        _scored(True, 0.5),
        _scored(True, 0.2, abstained=True),  # the system abstained: never answered
        _scored(False, 0.1, abstained=True),
    ]
    pts = accuracy_coverage(rows)
    assert [p.threshold for p in pts] == [0.9, 0.8, 0.7, 0.5]
    assert [p.coverage for p in pts] == [0.25, 0.25, 0.5, 0.75]
    assert [p.selective_accuracy for p in pts] == pytest.approx([1.0, 1.0, 0.5, 2 / 3])
    assert [p.unanswerable_abstain_rate for p in pts] == [1.0, 0.5, 0.5, 0.5]
    # The last point is the system's own decision: the report row's coverage and accuracy.
    row = summarize(rows)
    assert (pts[-1].coverage, pts[-1].selective_accuracy) == pytest.approx(
        (row["coverage"], row["selective_accuracy"])
    )
    assert row["abstention_auroc"] == pytest.approx(5 / 8)  # 0.9 > 0.8; all four > 0.1
    # Equal scores make one point; an answer without a score joins only at threshold None.
    tied = [_scored(True, 0.5), _scored(True, 0.5, right=False), _scored(True, None)]
    assert accuracy_coverage(tied) == [
        CoveragePoint(0.5, 2 / 3, 0.5, None),
        CoveragePoint(None, 1.0, pytest.approx(2 / 3), None),  # type: ignore[arg-type]
    ]
    assert accuracy_coverage([_scored(True, 0.4, abstained=True)]) == [
        CoveragePoint(None, 0.0, None, None)
    ]


def test_accuracy_coverage_never_loses_coverage():
    import random

    from selfrag.pipeline.evaluation.qa_metrics import accuracy_coverage

    rng = random.Random(7)
    for _ in range(50):
        rows = [
            _scored(
                rng.random() < 0.5,
                rng.choice([None, round(rng.random(), 1)]),
                right=rng.random() < 0.5,
                abstained=rng.random() < 0.2,
            )
            for _ in range(rng.randint(1, 30))
        ]
        pts = accuracy_coverage(rows)
        thresholds = [p.threshold for p in pts if p.threshold is not None]
        assert thresholds == sorted(set(thresholds), reverse=True)
        cov = [p.coverage for p in pts if p.coverage is not None]
        assert cov == sorted(cov) and all(0.0 <= c <= 1.0 for c in cov)
        row = summarize(rows)
        assert pts[-1].coverage == row["coverage"]
        assert pts[-1].selective_accuracy == pytest.approx(row["selective_accuracy"])


def test_paired_counts_split_the_questions_by_which_system_got_them_right():
    right, wrong = _o(True, "In France."), _o(True, "In Spain.")
    declined, answered = _o(False, "", abstained=True), _o(False, "In France.")
    pairs = [(right, right), (right, wrong), (right, wrong), (wrong, right), (wrong, wrong)]
    assert paired_counts(pairs) == PairedCounts(both=1, only_first=2, only_second=1, neither=1)
    assert paired_counts(pairs).questions == 5
    # An unanswerable question is right when the system abstained.
    assert paired_counts([(declined, answered)]) == PairedCounts(0, 1, 0, 0)


def test_mcnemar_p_value_by_hand():
    # 1 against 8 discordant questions: 2 * (C(9,0) + C(9,1)) / 2^9 = 20 / 512.
    assert PairedCounts(18, 1, 8, 18).p_value == pytest.approx(20 / 512)
    assert PairedCounts(18, 8, 1, 18).p_value == pytest.approx(20 / 512)  # symmetric
    assert PairedCounts(0, 0, 4, 0).p_value == pytest.approx(2 / 16)
    assert PairedCounts(5, 3, 3, 5).p_value == 1.0  # an even split is capped at 1
    assert PairedCounts(7, 0, 0, 2).p_value == 1.0  # no discordant question
