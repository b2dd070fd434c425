"""Long-form metrics on hand-computed examples: facts stated, [n] markers read sentence by
sentence, citation recall and precision (facts and fillers), and the per-system summary."""

from __future__ import annotations

import pytest

from selfrag.pipeline.evaluation.longform_metrics import (
    Fact,
    SourcePassage,
    Unit,
    grounded,
    judge_answer,
    marker_units,
    strip_markers,
    summarize_longform,
)

FACTS = (
    Fact("a", ("lysozyme",)),
    Fact("b", ("7 March 1929", "March 7, 1929")),
    Fact("c", ("Journal of Experimental Pathology",)),
)
PASSAGES = {
    "p1": SourcePassage("Fleming found lysozyme in nasal mucus.", "Alexander Fleming"),
    "p2": SourcePassage("He named the substance penicillin on 7 March 1929.", "Alexander Fleming"),
    "p3": SourcePassage("The Eads Bridge crosses the Mississippi at St. Louis.", "Eads Bridge"),
}


def test_markers_are_read_sentence_by_sentence_and_numbered_over_the_passages():
    text = (
        "Fleming found lysozyme [1]. He named penicillin on 7 March 1929. [2][3]\n"
        "It was published later [1, 3].\n[2]\nThe rest is unknown [7]. No citation here."
    )
    units = marker_units(text, ["p1", "p2", "p3"])
    assert units == [
        Unit("Fleming found lysozyme.", ("p1",)),
        # Markers after the sentence's end belong to it.
        Unit("He named penicillin on 7 March 1929.", ("p2", "p3")),
        # A line of markers alone joins the sentence before it.
        Unit("It was published later.", ("p1", "p3", "p2")),
        # A number naming no passage stays a citation that nothing backs.
        Unit("The rest is unknown.", ("[7]",)),
        Unit("No citation here.", ()),
    ]
    assert marker_units("See [Passage 2]; it says so.", ["x", "y"]) == [
        Unit("See; it says so.", ("y",))
    ]
    assert marker_units("", ["x"]) == []
    assert marker_units("1. Lysozyme [1]\n2. In 1929 [2]", ["x", "y"]) == [
        Unit("Lysozyme", ("x",)),
        Unit("In 1929", ("y",)),
    ]
    # A marker opening a line labels the sentence after it; one at the start cites forward.
    assert marker_units("[1]. Lysozyme.\n[2]. In 1929. Later.\n[1]", ["x", "y"]) == [
        Unit("Lysozyme.", ("x",)),
        Unit("In 1929.", ("y",)),
        Unit("Later.", ("x",)),
    ]
    assert strip_markers("lysozyme [1] and 1929 [2, 3].") == "lysozyme and 1929."


def test_a_filler_is_grounded_when_its_names_numbers_and_most_words_are_in_the_passage():
    evidence = "Coronation Park\nThe park in Delhi hosted three Durbars for the British."
    assert grounded("Coronation Park hosted three Durbars in Delhi.", evidence)
    # A name the passage lacks: not grounded, whatever the words.
    assert not grounded("Coronation Park hosted three Durbars in Mumbai.", evidence)
    # Content words: park, hosted, durbars, grand, ceremonies → 3 of 5 found, under 0.8.
    assert not grounded("The park hosted Durbars, grand ceremonies.", evidence)
    # Nothing to ground: a unit without a content word.
    assert not grounded("It is.", evidence)


def test_judge_answer_counts_facts_stated_cited_and_units_supported():
    units = [
        # States a (held by p1, cited): supported, and a is cited.
        Unit("Fleming found lysozyme.", ("p1",)),
        # States b, cites p3 which does not hold it: unsupported, b stated but not cited.
        Unit("He named penicillin on 7 March 1929.", ("p3",)),
        # A filler grounded in its passage: supported.
        Unit("The Eads Bridge crosses the Mississippi.", ("p3",)),
        # A filler its passage does not ground: unsupported.
        Unit("Fleming won the Nobel Prize.", ("p2",)),
        # Cites nothing: no precision judgement.
        Unit("That is all.", ()),
    ]
    answer = " ".join(u.text for u in units)
    j = judge_answer(answer, units, PASSAGES, FACTS, abstained=False)
    assert j.facts == ("a", "b", "c")
    assert j.stated == ("a", "b") and j.cited == ("a",)
    assert j.retrieved == ("a", "b")  # no passage given holds c
    assert [u.states for u in j.units] == [("a",), ("b",), (), (), ()]
    assert [u.supported for u in j.units] == [True, False, True, False, None]
    assert not j.covered
    # Several citations are one set: one passage holding a stated fact suffices.
    (u,) = judge_answer(
        "It was 7 March 1929.",
        [Unit("It was 7 March 1929.", ("p3", "p2"))],
        PASSAGES,
        FACTS,
        abstained=False,
    ).units
    assert u.supported
    # A citation to a passage the answer was not given holds nothing.
    (u,) = judge_answer(
        "lysozyme", [Unit("lysozyme", ("[7]",))], PASSAGES, FACTS, abstained=False
    ).units
    assert u.supported is False


def test_an_abstained_answer_states_nothing():
    j = judge_answer("lysozyme", [Unit("lysozyme", ("p1",))], PASSAGES, FACTS, abstained=True)
    assert j.stated == () and j.units == () and j.abstained
    assert j.retrieved == ("a", "b")


def test_summary_pools_facts_and_units():
    full = judge_answer(
        "lysozyme, 7 March 1929, Journal of Experimental Pathology",
        [
            Unit("Fleming found lysozyme.", ("p1",)),
            Unit(
                "On March 7, 1929 he named it, in the Journal of Experimental Pathology.", ("p2",)
            ),
        ],
        PASSAGES,
        FACTS,
        abstained=False,
    )
    assert full.covered and full.stated == ("a", "b", "c")
    partial = judge_answer(
        "He found lysozyme.",
        [
            Unit("He found lysozyme.", ("p2",)),
            Unit("The Eads Bridge crosses the Mississippi.", ("p3", "p1")),
        ],
        PASSAGES,
        FACTS,
        abstained=False,
    )
    none = judge_answer("", [], PASSAGES, FACTS, abstained=True)
    row = summarize_longform([full, partial, none])
    # Facts: 3 + 1 + 0 stated of 9. Full: a cited (p1), b cited (p2 holds 7 March 1929), c not
    # (no passage holds it); partial: a stated, cited to p2 which lacks it.
    assert full.cited == ("a", "b")
    assert row["facts"] == 9 and row["facts_stated"] == 4
    assert row["fact_recall"] == pytest.approx(4 / 9)
    assert row["fully_covered"] == pytest.approx(1 / 3)
    assert row["facts_retrieved"] == pytest.approx(6 / 9)
    assert row["citation_recall"] == pytest.approx(2 / 4)
    # Citing units: full's two (both supported), partial's two (unsupported fact unit, grounded
    # filler): 3 of 4; fact units 2 of 3; the one filler is supported.
    assert row["citing_units"] == 4 and row["filler_units"] == 1
    assert row["citation_precision"] == pytest.approx(3 / 4)
    assert row["citation_precision_facts"] == pytest.approx(2 / 3)
    assert row["filler_precision"] == 1.0
    assert row["units_per_answer"] == 2.0  # over the two answers given
    assert row["citations_per_unit"] == pytest.approx(5 / 4)
    assert row["abstain_rate"] == pytest.approx(1 / 3)
    empty = summarize_longform([])
    assert empty["fact_recall"] is None and empty["citation_precision"] is None
