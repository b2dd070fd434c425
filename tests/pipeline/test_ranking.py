"""pipeline/ranking.py: segment flags, a later unsupported or repeating segment dropped, and
what a later segment adds scored."""

import pytest

from selfrag.pipeline.critics import Branch, LabelProbs
from selfrag.pipeline.protocols import Generation, Passage
from selfrag.pipeline.ranking import Candidate, Drafted, Hypothesis, rank_step
from selfrag.schemas.answer import Citation
from selfrag.schemas.decoding import DecodingConfig

ROLLO = Passage("p1", "Rollo founded Normandy in 911.", "Normans", 0.9)
CFG = DecodingConfig(
    min_relevance=0.0, relevance_margin=1.0, min_support="none", min_support_score=0.0
)


def drafted(text: str, *, cited: bool, retrieved: bool = True, full: float = 0.9, **kw) -> Drafted:
    kw.setdefault("novelty", 1.0)
    return Drafted(
        parent=0,
        retrieved=retrieved,
        p_ret=None,
        citation=Citation(passage_id="p1") if cited else None,
        text=text,
        logprob=-1.0,
        n_tokens=4,
        finished=False,
        rel={"relevant": 0.9, "irrelevant": 0.1} if cited else None,
        sup={"full": full, "partial": 0.0, "none": 1 - full} if cited else None,
        use=None,
        **kw,
    )


def test_a_drafted_branch_records_the_names_and_numbers_its_passage_lacks():
    c = Candidate(0, Branch("Who founded Normandy?", "", ROLLO), True, None)
    text = " The Normans' Rollo founded it in 876 with Hastein."  # "Normans": the title's
    c.draft = Generation([1, 2], text, [-0.1, -0.1], "eos", 0)
    c.rel = LabelProbs({"relevant": 0.9, "irrelevant": 0.1}, 0)
    assert c.drafted().unsupported_terms == ("876", "Hastein")


def test_flags_say_what_to_check_in_a_first_segment():
    (h,) = rank_step(
        [Hypothesis()],
        [Hypothesis()],
        [drafted(" Rollo in 876.", cited=True, full=0.3, unsupported_terms=("876",))],
        CFG,
    ).beam
    assert h.segments[0].flags == ["unsupported_terms", "low_support"]
    assert h.segments[0].unsupported_terms == ["876"]


def test_a_later_uncited_segment_is_dropped_and_the_answer_goes_on_unless_kept():
    first = rank_step([Hypothesis()], [Hypothesis()], [drafted(" Rollo.", cited=True)], CFG)
    parent = first.beam[0]
    assert parent.segments[0].flags == []
    assert (parent.part, parent.misses) == (1, 0)
    later = [drafted(" He died in 932.", cited=False, retrieved=False)]
    dropped = rank_step([parent], [parent], later, CFG)
    assert dropped.filtered == 1
    (h,) = dropped.beam
    # Not ended here: the stop rule (pipeline.coverage.settle) decides whether it goes on.
    assert not h.done and len(h.segments) == 1 and (h.part, h.misses) == (2, 1)
    kept = rank_step(
        [parent], [parent], later, CFG.model_copy(update={"keep_unsupported_segments": True})
    )
    (h,) = kept.beam
    assert len(h.segments) == 2 and h.segments[1].flags == ["uncited"]


def test_a_later_segment_stating_what_its_passage_lacks_is_dropped():
    parent = rank_step([Hypothesis()], [Hypothesis()], [drafted(" Rollo.", cited=True)], CFG).beam[
        0
    ]
    later = [drafted(" In 876.", cited=True, unsupported_terms=("876",))]
    (h,) = rank_step([parent], [parent], later, CFG).beam
    assert len(h.segments) == 1 and h.misses == 1


def test_a_later_segment_that_says_nothing_new_is_dropped():
    parent = rank_step([Hypothesis()], [Hypothesis()], [drafted(" Rollo.", cited=True)], CFG).beam[
        0
    ]
    repeat = [drafted(" Rollo founded it.", cited=True, novelty=0.1)]
    (h,) = rank_step([parent], [parent], repeat, CFG).beam
    assert len(h.segments) == 1
    lenient = CFG.model_copy(update={"min_novelty": 0.0})
    (h,) = rank_step([parent], [parent], repeat, lenient).beam
    assert len(h.segments) == 2 and h.segments[1].novelty == 0.1


def test_a_later_segment_that_adds_more_ranks_higher():
    parent = rank_step([Hypothesis()], [Hypothesis()], [drafted(" Rollo.", cited=True)], CFG).beam[
        0
    ]
    same = drafted(" Rollo led them.", cited=True, novelty=0.3)
    more = drafted(" He was baptised in 912.", cited=True, novelty=0.9)
    beam = rank_step([parent], [parent], [same, more], CFG.model_copy(update={"beam": 2})).beam
    assert [h.segments[1].text for h in beam] == [" He was baptised in 912.", " Rollo led them."]
    assert beam[0].score - beam[1].score == pytest.approx(CFG.w_new * (0.9 - 0.3))


def test_the_first_segment_scores_no_novelty():
    novel = drafted(" Rollo.", cited=True, novelty=1.0)
    plain = drafted(" Rollo.", cited=True, novelty=0.0)
    (a,) = rank_step([Hypothesis()], [Hypothesis()], [novel], CFG).beam
    (b,) = rank_step([Hypothesis()], [Hypothesis()], [plain], CFG).beam
    assert a.score == b.score


def test_a_draft_cut_mid_sentence_stays_on_its_part():
    (h,) = rank_step(
        [Hypothesis()], [Hypothesis()], [drafted(" Rollo and", cited=True, cut=True)], CFG
    ).beam
    assert h.cut and h.part == 0


def test_a_drafted_branch_knows_what_it_adds_to_the_question_and_answer_so_far():
    c = Candidate(0, Branch("Who founded Normandy?", " Rollo did.", ROLLO), True, None)
    c.draft = Generation([1], " Rollo founded Normandy in 911.", [-0.1], "length", 0)
    d = c.drafted()
    assert d.cut and d.novelty == 0.25  # "rollo", "founded", "normandy" were said; "911" is new


def test_a_closed_book_answer_is_not_flagged_uncited():
    (h,) = rank_step(
        [Hypothesis()], [Hypothesis()], [drafted(" Paris.", cited=False, retrieved=False)], CFG
    ).beam
    assert h.segments[0].flags == []
