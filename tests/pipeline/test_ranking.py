"""pipeline/ranking.py: segment flags, and a later unsupported segment ending the answer."""

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


def test_a_later_uncited_segment_ends_the_answer_unless_kept():
    first = rank_step([Hypothesis()], [Hypothesis()], [drafted(" Rollo.", cited=True)], CFG)
    parent = first.beam[0]
    assert parent.segments[0].flags == []
    later = [drafted(" He died in 932.", cited=False, retrieved=False)]
    ended = rank_step([parent], [parent], later, CFG)
    assert ended.filtered == 1
    (h,) = ended.beam
    assert h.done and not h.abstained and len(h.segments) == 1
    kept = rank_step(
        [parent], [parent], later, CFG.model_copy(update={"keep_unsupported_segments": True})
    )
    (h,) = kept.beam
    assert len(h.segments) == 2 and h.segments[1].flags == ["uncited"]


def test_a_later_segment_stating_what_its_passage_lacks_ends_the_answer():
    parent = rank_step([Hypothesis()], [Hypothesis()], [drafted(" Rollo.", cited=True)], CFG).beam[
        0
    ]
    later = [drafted(" In 876.", cited=True, unsupported_terms=("876",))]
    (h,) = rank_step([parent], [parent], later, CFG).beam
    assert h.done and len(h.segments) == 1


def test_a_closed_book_answer_is_not_flagged_uncited():
    (h,) = rank_step(
        [Hypothesis()], [Hypothesis()], [drafted(" Paris.", cited=False, retrieved=False)], CFG
    ).beam
    assert h.segments[0].flags == []
