"""pipeline/ranking.py: segment flags, a later unsupported or repeating segment dropped, and
what a later segment adds scored."""

from dataclasses import replace

import pytest

from selfrag.pipeline.critics import Branch, LabelProbs
from selfrag.pipeline.grounding import new_words
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


def cited_draft(passage: str, text: str, *, score: float = 0.9, **kw) -> Drafted:
    """A grounded draft of `passage` whose support read is `score` (ranked by it)."""
    kw.setdefault("new_words", new_words(text, ""))
    return replace(
        drafted(text, cited=True, full=score, **kw), citation=Citation(passage_id=passage)
    )


def test_an_account_step_keeps_each_new_supported_draft_of_its_passages_best_first():
    parent = Hypothesis(step_segments=3)
    drafts = [
        cited_draft("p2", " She was born in Evesham.", score=0.6),
        cited_draft("p1", " She founded Twycross Zoo.", score=0.9),
        cited_draft("p3", " The zoo opened in 1963.", score=0.7),
    ]
    (h,) = rank_step([parent], [parent], drafts, CFG).beam
    assert [s.citation.passage_id for s in h.segments] == ["p1", "p3", "p2"]
    assert h.step_segments == 3 and h.part == 1 and not h.done
    (one,) = rank_step([Hypothesis()], [Hypothesis()], drafts, CFG).beam
    assert [s.citation.passage_id for s in one.segments] == ["p1"]
    # An answer's first step drafts without a leading space; its segments still read apart.
    firsts = [replace(d, text=d.text.strip()) for d in drafts]
    (h,) = rank_step([parent], [parent], firsts, CFG).beam
    assert h.text == "She founded Twycross Zoo. The zoo opened in 1963. She was born in Evesham."


def test_an_account_step_skips_what_its_first_segment_said_a_second_draft_of_a_passage_and_a_cut():
    parent = Hypothesis(step_segments=4)
    drafts = [
        cited_draft("p1", " She founded Twycross Zoo.", score=0.9),
        cited_draft("p2", " She founded Twycross Zoo.", score=0.8),  # nothing new after p1's
        cited_draft("p1", " She bred dogs.", score=0.7),  # p1 is cited already this step
        cited_draft("p3", " The zoo opened in", score=0.6, cut=True),
        cited_draft("p4", " Chimpanzees starred in adverts.", score=0.5),
    ]
    (h,) = rank_step([parent], [parent], drafts, CFG).beam
    # The beam keeps the step's best total: p2's draft, then p1's other one, then p4's.
    assert [(s.citation.passage_id, s.text) for s in h.segments] == [
        ("p2", " She founded Twycross Zoo."),
        ("p1", " She bred dogs."),
        ("p4", " Chimpanzees starred in adverts."),
    ]
    assert not h.cut
    (first,) = rank_step([parent], [parent], drafts[:2], CFG).beam
    assert len(first.segments) == 1  # the same statement from another passage adds nothing


def test_a_segment_past_the_answer_budget_is_not_kept_and_a_full_budget_ends_the_answer():
    cfg = CFG.model_copy(update={"max_answer_tokens": 10})
    parent = Hypothesis(step_segments=3)
    facts = [" Born in Evesham.", " Founded Twycross Zoo.", " Trained chimpanzees."]
    drafts = [cited_draft(f"p{i}", t, score=0.9 - i / 10) for i, t in enumerate(facts)]
    (h,) = rank_step([parent], [parent], drafts, cfg).beam  # 4 tokens each: two fit in 10
    assert len(h.segments) == 2 and h.tokens == 8 and not h.done
    (h,) = rank_step([h], [h], [cited_draft("p9", " Kept studbooks.")], cfg).beam
    assert len(h.segments) == 2 and h.misses == 1
    exact = cfg.model_copy(update={"max_answer_tokens": 8})
    (h,) = rank_step([parent], [parent], drafts, exact).beam
    assert h.tokens == 8 and h.done
