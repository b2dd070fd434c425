import pytest

from selfrag.pipeline.branching import draft_order
from selfrag.pipeline.coverage import MAX_MISSES
from selfrag.pipeline.critics import Branch, LabelProbs, settle_filters
from selfrag.pipeline.decoder import ABSTAIN_MESSAGE, BeamDecoder
from selfrag.pipeline.protocols import Passage
from selfrag.pipeline.ranking import Candidate
from selfrag.schemas.decoding import DecodingConfig
from tests.fakes import ListRetriever, ScriptedCritic

PASSAGES = [
    Passage("p1", "Normandy is a region of France.", "Normandy", 0.9),
    Passage("p2", "Rollo was a Viking leader.", "Rollo", 0.8),
    Passage("p3", "Bananas are yellow.", "Banana", 0.7),
]


def make(critic: ScriptedCritic, passages=PASSAGES, clock=None):
    retriever = ListRetriever(list(passages))
    kwargs = {"clock": clock} if clock else {}
    return BeamDecoder(lambda _: critic, retriever, "test-model", **kwargs), retriever


def cfg(**kw) -> DecodingConfig:
    # Pin the scoring dials these tests compute by hand (their defaults are tuned elsewhere),
    # and draft every branch the filters keep: these tests rank several drafts.
    base = {
        "max_segments": 1,
        "top_k": 3,
        "w_rel": 1.0,
        "length_normalize": False,
        "max_drafts": 50,
    }
    # Settled as the answer path would for the scripted critic (no filter defaults: off).
    return settle_filters(DecodingConfig(**{**base, **kw}), "scripted")


def test_best_branch_wins_and_carries_citation_and_scores():
    critic = ScriptedCritic(
        relevance_of={"p1": 0.9, "p2": 0.8, "p3": 0.1},
        drafts={
            "p1": (" Normandy is in France.", -1.0, "eos"),
            "p2": (" Rollo led Vikings.", -1.0, "eos"),
            "p3": (" Bananas.", -1.0, "eos"),
            None: (" I think France.", -0.5, "eos"),
        },
        support_of={"p1": {"full": 0.9, "partial": 0.05, "none": 0.05}, "p2": {"none": 1.0}},
    )
    decoder, retriever = make(critic)
    out = decoder.answer("Where is Normandy?", cfg())
    assert out.answer == "Normandy is in France."
    seg = out.segments[0]
    assert seg.citation is not None and seg.citation.passage_id == "p1"
    assert seg.s_rel == pytest.approx(0.9)
    assert seg.s_sup == pytest.approx(0.925)
    assert seg.s_use == pytest.approx(1.0)
    assert seg.p_ret == pytest.approx(0.9)
    assert seg.score == pytest.approx(-1.0 + 0.9 + 0.925 + 0.5)
    assert out.usage.retrievals == 1
    assert out.usage.branches_opened == 4
    assert retriever.queries == ["Where is Normandy?"]
    assert out.passages[0].id == "p1"


def test_weights_change_the_winner():
    critic = ScriptedCritic(
        relevance_of={"p1": 0.95, "p2": 0.80},
        drafts={"p1": (" A.", -0.9, "eos"), "p2": (" B.", -1.3, "eos"), None: (" C.", -9.0, "eos")},
        support_of={"p1": {"full": 0.4, "none": 0.6}, "p2": {"full": 0.95, "none": 0.05}},
        utility_of={"p1": {"5": 0.9, "1": 0.1}, "p2": {"5": 0.8, "1": 0.2}},
    )
    decoder, _ = make(critic, PASSAGES[:2])
    assert decoder.answer("q", cfg(w_sup=1.0)).segments[0].citation.passage_id == "p1"
    assert decoder.answer("q", cfg(w_sup=2.0)).segments[0].citation.passage_id == "p2"


def test_low_relevance_branches_are_pruned_before_drafting():
    critic = ScriptedCritic(relevance_of={"p1": 0.9, "p2": 0.2, "p3": 0.1})
    decoder, _ = make(critic)
    out = decoder.answer("q", cfg(min_relevance=0.5))
    assert out.usage.branches_pruned == 2
    assert "draft:2" in critic.calls  # p1 and the no-retrieval branch only


def test_relevance_margin_drafts_only_passages_near_the_best():
    critic = ScriptedCritic(relevance_of={"p1": 0.9, "p2": 0.8, "p3": 0.3})
    decoder, _ = make(critic)
    out = decoder.answer("q", cfg(relevance_margin=0.15))
    assert out.usage.branches_pruned == 1  # p3: 0.6 below the best
    assert "draft:3" in critic.calls
    critic.calls.clear()
    out = decoder.answer("q", cfg(relevance_margin=0.0))
    assert out.usage.branches_pruned == 2
    assert "draft:2" in critic.calls  # p1 and the no-retrieval branch
    assert out.segments[0].citation.passage_id == "p1"


def test_max_drafts_drafts_the_most_relevant_passages_only():
    critic = ScriptedCritic(relevance_of={"p1": 0.7, "p2": 0.9, "p3": 0.8})
    decoder, _ = make(critic)
    out = decoder.answer("q", cfg(max_drafts=2, draft_order_margin=0.0))
    assert out.usage.branches_pruned == 1  # p1, the least relevant of three
    assert "draft:3" in critic.calls  # p2, p3 and the no-retrieval branch
    critic.calls.clear()
    out = decoder.answer("q", cfg(max_drafts=1, relevance_margin=0.05))
    assert out.usage.branches_pruned == 2  # p1 by the margin, p3 by the budget
    assert "draft:2" in critic.calls
    assert out.segments[0].citation.passage_id == "p2"


def test_by_default_the_retriever_s_first_passage_drafts_unless_another_reads_far_more_relevant():
    config = settle_filters(DecodingConfig(mode="always", max_segments=1), "scripted")
    critic = ScriptedCritic(relevance_of={"p1": 0.8, "p2": 0.9, "p3": 0.85})
    decoder, _ = make(critic)
    out = decoder.answer("q", config)
    assert out.usage.branches_pruned == 2  # p2 and p3: the budget, not the filters
    assert "draft:2" in critic.calls  # p1 and the no-retrieval branch
    assert out.segments[0].citation.passage_id == "p1"
    # p1 reads 0.5 or more: no passage can read more than the margin (0.5) above it, so the
    # others are not read.
    assert [c for c in critic.calls if c.startswith("relevance")] == ["relevance:1"]
    # p3's read is more than draft_order_margin above p1's: the critique's clear call, which
    # p1's weak read opens by having p2 and p3 read.
    critic = ScriptedCritic(relevance_of={"p1": 0.3, "p2": 0.75, "p3": 0.85})
    decoder, _ = make(critic)
    out = decoder.answer("q", config)
    assert out.segments[0].citation.passage_id == "p3"
    assert out.segments[0].s_rel == pytest.approx(0.85)
    assert [c for c in critic.calls if c.startswith("relevance")] == ["relevance:1", "relevance:2"]


def test_every_passage_is_read_under_a_relevance_filter_and_none_past_the_budget_at_margin_1():
    for dials in ({"min_relevance": 0.2}, {"relevance_margin": 0.9}, {"require_relevant": True}):
        critic = ScriptedCritic(relevance_of={"p1": 0.9, "p2": 0.75, "p3": 0.85})
        decoder, _ = make(critic)
        config = settle_filters(DecodingConfig(mode="always", max_segments=1, **dials), "scripted")
        decoder.answer("q", config)
        assert [c for c in critic.calls if c.startswith("relevance")] == ["relevance:3"], dials
    critic = ScriptedCritic(relevance_of={"p1": 0.0, "p2": 0.75, "p3": 0.85})
    decoder, _ = make(critic)
    dials = {"draft_order_margin": 1.0, "max_drafts": 2}
    config = settle_filters(DecodingConfig(mode="always", max_segments=1, **dials), "scripted")
    out = decoder.answer("q", config)
    assert [c for c in critic.calls if c.startswith("relevance")] == ["relevance:2"]
    assert out.usage.branches_pruned == 1  # p3


def test_draft_order_keeps_the_retriever_s_order_below_the_margin():
    def cand(parent: int, name: str, s_rel: float) -> Candidate:
        c = Candidate(parent, Branch("q", "", Passage(name, "t")), True, None)
        c.rel = LabelProbs({"relevant": s_rel, "irrelevant": 1 - s_rel}, 0)
        return c

    a, b, c, d = cand(0, "a", 0.1), cand(0, "b", 0.7), cand(0, "c", 0.65), cand(1, "d", 0.9)
    e = cand(1, "e", 0.99)
    names = [x.branch.passage.id for x in draft_order([a, b, c, d, e], 0.5)]
    assert names == ["b", "c", "a", "d", "e"]  # b, c over a by > 0.5; e not over d
    assert [x.branch.passage.id for x in draft_order([a, b, c], 1.0)] == ["a", "b", "c"]
    assert [x.branch.passage.id for x in draft_order([a, c, b], 0.0)] == ["b", "c", "a"]


def test_margin_is_measured_within_each_hypothesis():
    # Two hypotheses after step 1 (beam 2); each keeps its own best passage at step 2.
    critic = ScriptedCritic(relevance_of={"p1": 0.9, "p2": 0.2})
    decoder, _ = make(critic, PASSAGES[:2])
    out = decoder.answer("q", cfg(max_segments=2, beam=2, relevance_margin=0.0))
    assert out.usage.branches_pruned == out.usage.retrievals  # one p2 per retrieval step
    assert out.usage.evidence_branches == 2 * out.usage.retrievals


def test_branches_the_filters_reject_are_not_drafted():
    critic = ScriptedCritic(relevance_of={"p1": 0.9, "p2": 0.8, "p3": 0.7})
    decoder, _ = make(critic)
    out = decoder.answer("q", cfg(min_support_score=0.1))
    assert "draft:3" in critic.calls  # no draft for the no-retrieval branch: it cannot win
    assert out.usage.branches_filtered >= 1
    critic.calls.clear()
    decoder.answer("q", cfg(min_support_score=0.1, on_unsupported="no_retrieval"))
    assert "draft:4" in critic.calls  # now it is the fallback


def test_never_mode_does_not_retrieve_or_ask():
    critic = ScriptedCritic()
    decoder, retriever = make(critic)
    out = decoder.answer("q", cfg(mode="never"))
    assert retriever.queries == []
    assert not any(c.startswith("retrieval") for c in critic.calls)
    assert out.segments[0].citation is None and out.segments[0].p_ret is None


def test_adaptive_threshold_decides():
    critic = ScriptedCritic(p_retrieve=0.3)
    decoder, retriever = make(critic)
    decoder.answer("q", cfg(mode="adaptive", threshold=0.5))
    assert retriever.queries == []
    decoder.answer("q", cfg(mode="adaptive", threshold=0.2))
    assert len(retriever.queries) == 1


def test_always_mode_retrieves_without_asking():
    critic = ScriptedCritic(p_retrieve=0.0)
    decoder, retriever = make(critic)
    out = decoder.answer("q", cfg(mode="always"))
    assert len(retriever.queries) == 1
    assert not any(c.startswith("retrieval") for c in critic.calls)
    assert out.segments[0].p_ret is None


def test_min_support_filter_makes_branch_unavailable_not_just_worse():
    critic = ScriptedCritic(
        relevance_of={"p1": 0.99, "p2": 0.5},
        drafts={"p1": (" Great.", -0.1, "eos"), "p2": (" Fine.", -5.0, "eos")},
        support_of={"p1": {"none": 0.9, "full": 0.1}, "p2": {"partial": 0.8, "none": 0.2}},
    )
    decoder, _ = make(critic, PASSAGES[:2])
    out = decoder.answer("q", cfg(min_support="partial"))
    assert out.segments[0].citation.passage_id == "p2"
    assert out.usage.branches_filtered == 2  # p1 and the no-retrieval branch


def test_everything_filtered_abstains_with_a_message():
    critic = ScriptedCritic(
        support_of={"p1": {"none": 1.0}, "p2": {"none": 1.0}, "p3": {"none": 1.0}}
    )
    decoder, _ = make(critic)
    out = decoder.answer("q", cfg(min_support="full"))
    assert out.abstained
    assert out.answer == ABSTAIN_MESSAGE
    assert out.segments == []


def test_everything_filtered_can_fall_back_to_no_retrieval():
    critic = ScriptedCritic(
        support_of={"p1": {"none": 1.0}, "p2": {"none": 1.0}, "p3": {"none": 1.0}},
        drafts={None: (" From memory.", -2.0, "eos")},
    )
    decoder, _ = make(critic)
    out = decoder.answer("q", cfg(min_support="full", on_unsupported="no_retrieval"))
    assert not out.abstained
    assert out.answer == "From memory."
    assert out.segments[0].citation is None


def test_support_is_what_min_support_score_thresholds():
    # s_sup: p1 0.3, p2 0.6 (but irrelevant), p3 0.45; only the first step counts.
    critic = ScriptedCritic(
        relevance_of={"p1": 0.9, "p2": 0.2, "p3": 0.8},
        drafts={"p1": (" A.", -0.1, "eos"), "p2": (" B.", -0.1, "eos"), None: (" C.", -9, "eos")},
        support_of={
            "p1": {"full": 0.3, "none": 0.7},
            "p2": {"full": 0.6, "none": 0.4},
            "p3": {"full": 0.45, "none": 0.55},
        },
    )
    decoder, _ = make(critic)
    out = decoder.answer("q", cfg())  # no filter: answered, support still reported
    assert not out.abstained and out.support == pytest.approx(0.6)
    # Every other filter applies: with require_relevant, p2 (irrelevant) does not count.
    assert decoder.answer("q", cfg(require_relevant=True)).support == pytest.approx(0.45)
    for threshold in (0.2, 0.44, 0.46, 0.59, 0.61, 0.9):
        out = decoder.answer("q", cfg(min_support_score=threshold))
        assert out.support == pytest.approx(0.6)
        assert out.abstained == (out.support < threshold), threshold
        if not out.abstained:
            assert out.segments[0].s_sup >= threshold
    # Nothing grounded drafted (every passage pruned, or no retrieval): no support score.
    assert decoder.answer("q", cfg(min_relevance=0.95)).support is None
    assert decoder.answer("q", cfg(mode="never")).support is None


def test_the_support_threshold_weighs_s_sup_by_the_passages_similarity():
    # p1 reads s_sup 0.9 on a passage far from the question (similarity 0.4): 0.36; p2 reads
    # 0.6 on a close one (0.9): 0.54. The threshold compares those, the ranking keeps s_sup.
    passages = [
        Passage("p1", "Normandy is a region of France.", "Normandy", 0.9, similarity=0.4),
        Passage("p2", "Rollo was a Viking leader.", "Rollo", 0.8, similarity=0.9),
    ]
    critic = ScriptedCritic(
        relevance_of={"p1": 0.9, "p2": 0.9},
        drafts={"p1": (" A.", -0.1, "eos"), "p2": (" B.", -0.1, "eos"), None: (" C.", -9, "eos")},
        support_of={"p1": {"full": 0.9, "none": 0.1}, "p2": {"full": 0.6, "none": 0.4}},
    )
    decoder, _ = make(critic, passages)
    out = decoder.answer("q", cfg())
    assert out.support == pytest.approx(0.54)
    assert out.segments[0].citation.passage_id == "p1"  # unfiltered, s_sup ranks
    assert out.segments[0].s_sup == pytest.approx(0.9)
    assert [p.similarity for p in out.passages] == [0.4, 0.9]
    out = decoder.answer("q", cfg(min_support_score=0.5))
    assert not out.abstained and out.segments[0].citation.passage_id == "p2"
    assert decoder.answer("q", cfg(min_support_score=0.55)).abstained


def test_each_collection_holds_its_passages_to_its_own_support_threshold():
    # p1 (collection "squad") reads 0.6, p2 ("wiki") 0.5, p3 (no collection recorded) 0.45.
    passages = [
        Passage("p1", "Normandy is a region of France.", "N", 0.9, {"collection": "squad"}),
        Passage("p2", "Rollo was a Viking leader.", "R", 0.8, {"collection": "wiki"}),
        Passage("p3", "Bananas are yellow.", "B", 0.7),
    ]
    critic = ScriptedCritic(
        relevance_of={"p1": 0.9, "p2": 0.9, "p3": 0.9},
        drafts={
            "p1": (" A.", -0.1, "eos"),
            "p2": (" B.", -0.1, "eos"),
            "p3": (" C.", -0.1, "eos"),
            None: (" D.", -9, "eos"),
        },
        support_of={
            "p1": {"full": 0.6, "none": 0.4},
            "p2": {"full": 0.5, "none": 0.5},
            "p3": {"full": 0.45, "none": 0.55},
        },
    )
    decoder, _ = make(critic, passages)
    own = {"squad": 0.7, "wiki": 0.4}
    out = decoder.answer("q", cfg(min_support_score=0.4, min_support_score_by_corpus=own))
    # p1 falls under squad's 0.7; p2 clears wiki's 0.4 by 0.1, p3 the one for all by 0.05.
    assert not out.abstained and out.segments[0].citation.passage_id == "p2"
    assert out.support == pytest.approx(0.5) and out.support_threshold == pytest.approx(0.4)
    # Each passage shown names its corpus, the key of its threshold.
    assert {p.id: p.corpus for p in out.passages} == {"p1": "squad", "p2": "wiki", "p3": None}
    # Every passage under its own threshold: abstains, reporting the closest call.
    own = {"squad": 0.9, "wiki": 0.55}
    out = decoder.answer("q", cfg(min_support_score=0.5, min_support_score_by_corpus=own))
    assert out.abstained
    assert out.support == pytest.approx(0.45) and out.support_threshold == pytest.approx(0.5)
    # Thresholds per collection alone: a passage of no named collection is held to none ...
    own = {"squad": 0.9, "wiki": 0.9}
    out = decoder.answer("q", cfg(min_support_score_by_corpus=own))
    assert not out.abstained and out.segments[0].citation.passage_id == "p3"
    # ... and they still ask for evidence: no fallback to the draft without a passage.
    decoder, _ = make(critic, passages[:2])
    out = decoder.answer("q", cfg(min_support_score_by_corpus=own))
    assert out.abstained and out.answer == ABSTAIN_MESSAGE


def test_require_relevant_filter():
    critic = ScriptedCritic(
        relevance_of={"p1": 0.4, "p2": 0.6}, drafts={"p1": (" x.", -0.1, "eos")}
    )
    decoder, _ = make(critic, PASSAGES[:2])
    out = decoder.answer("q", cfg(require_relevant=True))
    assert out.segments[0].citation.passage_id == "p2"
    assert "draft:1" in critic.calls  # p1 and the no-retrieval branch could not pass
    assert out.usage.branches_filtered == 2


LISTED = "Who led the Vikings, where did they settle, and when did they arrive?"


def test_a_question_listing_parts_gets_a_segment_per_part_each_searched_for():
    critic = ScriptedCritic(
        drafts={"p1": (" First part.", -1.0, "sentence"), None: (" x.", -9.0, "sentence")},
    )
    decoder, retriever = make(critic, PASSAGES[:1])
    out = decoder.answer(LISTED, cfg(max_segments=5, min_novelty=0.0))
    assert len(out.segments) == 3 and out.usage.steps == 3
    assert out.answer == "First part. First part. First part."
    assert retriever.queries == [
        "Who led the Vikings?",
        "Where did they settle (Vikings)?",
        "When did they arrive (Vikings)?",
    ]
    # Each part is drafted on its own, free to end at once (only an account's continuation
    # must say something).
    assert {b.min_tokens for b in critic.drafted_branches} == {0}
    answer = decoder.answer(
        LISTED, cfg(max_segments=5, min_novelty=0.0, segment_retrieval="answer")
    )
    assert len(answer.segments) == 3
    assert retriever.queries[-1] == f"{LISTED} First part. First part."


def test_a_question_asking_one_thing_ends_after_its_first_sentence():
    critic = ScriptedCritic(
        drafts={"p1": (" First part.", -1.0, "sentence"), None: (" x.", -9.0, "sentence")},
    )
    decoder, _ = make(critic, PASSAGES[:1])
    out = decoder.answer("q", cfg(max_segments=3))
    assert len(out.segments) == 1 and out.usage.steps == 1


def test_a_first_segment_cut_mid_sentence_goes_on_searching_with_it():
    critic = ScriptedCritic(
        drafts={"p1": (" Rollo and", -1.0, "length"), None: (" x.", -9.0, "sentence")},
    )
    decoder, retriever = make(critic, PASSAGES[:1])
    out = decoder.answer("q", cfg(max_segments=2, min_novelty=0.0))
    assert len(out.segments) == 2
    assert retriever.queries[1] == "q Rollo and"


class ByPart(ListRetriever):
    """A retriever for `LISTED`: `settle` for the part asking where they settled, `first`
    for any other query."""

    def __init__(self, first: list[Passage], settle: list[Passage]) -> None:
        super().__init__([])
        self.first, self.settle = first, settle

    def search(self, query, k):
        self.queries.append(query)
        return self.settle if "settle" in query else self.first


def test_a_part_whose_evidence_fails_is_dropped_and_the_next_part_answered():
    critic = ScriptedCritic(
        relevance_of={"p1": 0.9, "p2": 0.9},
        drafts={"p1": (" Rollo led them.", -1.0, "sentence"), None: (" x.", -9.0, "sentence")},
        support_of={"p1": {"full": 0.9, "none": 0.1}, "p2": {"none": 1.0}},
    )

    # The second part finds only a passage that supports nothing it drafts.
    retriever = ByPart(first=[PASSAGES[0]], settle=[PASSAGES[1]])
    decoder = BeamDecoder(lambda _: critic, retriever, "test-model")
    out = decoder.answer(LISTED, cfg(max_segments=5, min_support_score=0.5, min_novelty=0.0))
    assert out.usage.steps == 3
    assert [s.citation.passage_id for s in out.segments] == ["p1", "p1"]
    assert not out.abstained


def test_a_later_draft_that_would_be_dropped_lets_the_next_passage_draft():
    passages = [
        Passage("p1", "Rollo led the Vikings.", "Rollo", 0.9),
        Passage("s1", "Rollo led the Vikings, who settled.", "Settle", 0.9),
        Passage("s2", "The Vikings settled in Normandy.", "Settle", 0.8),
    ]
    critic = ScriptedCritic(
        relevance_of={"p1": 0.9, "s1": 0.8, "s2": 0.85},
        drafts={
            "p1": (" Rollo led the Vikings.", -1.0, "eos"),
            "s1": (" Rollo led the Vikings.", -1.0, "eos"),  # nothing new: dropped
            "s2": (" They settled in Normandy.", -1.0, "eos"),
            None: (" x.", -9.0, "eos"),
        },
    )

    retriever = ByPart(first=passages[:1], settle=passages[1:])
    decoder = BeamDecoder(lambda _: critic, retriever, "test-model")
    config = cfg(max_segments=2, max_drafts=1, draft_order_margin=0.5)
    out = decoder.answer(LISTED, config)
    assert [s.citation.passage_id for s in out.segments] == ["p1", "s2"]
    none = decoder.answer(LISTED, config.model_copy(update={"retry_drafts": 0}))
    assert [s.citation.passage_id for s in none.segments] == ["p1"]


def test_later_searches_rank_the_passages_already_cited_last():
    critic = ScriptedCritic(
        relevance_of={"p1": 0.9, "p2": 0.8},
        drafts={
            "p1": (" Normandy is a region.", -1.0, "sentence"),
            "p2": (" Rollo was a Viking.", -1.0, "sentence"),
            None: (" x.", -9.0, "sentence"),
        },
    )
    decoder, _ = make(critic, PASSAGES[:2])
    diverse = decoder.answer(LISTED, cfg(max_segments=2, top_k=1, min_novelty=0.0))
    assert [s.citation.passage_id for s in diverse.segments] == ["p1", "p2"]
    same = decoder.answer(
        LISTED, cfg(max_segments=2, top_k=1, min_novelty=0.0, diverse_passages=False)
    )
    assert [s.citation.passage_id for s in same.segments] == ["p1", "p1"]


def test_static_retrieval_searches_once_and_every_step_chooses_among_those_passages():
    critic = ScriptedCritic(
        relevance_of={"p1": 0.9, "p2": 0.8},
        drafts={
            "p1": (" Normandy is a region.", -1.0, "sentence"),
            "p2": (" Rollo was a Viking.", -1.0, "sentence"),
            None: (" x.", -9.0, "sentence"),
        },
    )
    decoder, retriever = make(critic, PASSAGES[:2])
    out = decoder.answer(LISTED, cfg(max_segments=3, top_k=2, segment_retrieval="static"))
    assert retriever.queries == [LISTED]
    assert out.usage.retrievals == 1
    assert [s.citation.passage_id for s in out.segments][:2] == ["p1", "p2"]


def test_an_account_of_a_topic_goes_on_until_its_evidence_gives_nothing_new():
    passages = [
        Passage("n1", "Normandy is a region of France.", "Normandy", 0.9),
        Passage("n2", "Vikings settled there in 911.", "Normandy", 0.8),
        Passage("n3", "Normandy is a region of France.", "Normandy", 0.7),
        Passage("r1", "Rollo was a Viking leader.", "Rollo", 0.6),
    ]
    critic = ScriptedCritic(
        relevance_of={"n1": 0.9, "n2": 0.8, "n3": 0.7, "r1": 0.9},
        drafts={
            "n1": (" Normandy is a region.", -1.0, "eos"),
            "n2": (" Vikings settled there.", -1.0, "eos"),
            "n3": (" Normandy is a region.", -1.0, "eos"),
            "r1": (" Rollo led Vikings.", -1.0, "eos"),
            None: (" x.", -9.0, "eos"),
        },
    )
    decoder, retriever = make(critic, passages)
    out = decoder.answer("Tell me about Normandy.", cfg(max_segments=6, top_k=1))
    # Each step drafts from a passage about Normandy not drafted on yet; the third repeats
    # the first (dropped), the later ones find none left (Rollo's is not about Normandy), and
    # after MAX_MISSES steps in a row add nothing the answer ends, short of max_segments.
    assert [s.citation.passage_id for s in out.segments] == ["n1", "n2"]
    assert out.usage.steps == 2 + MAX_MISSES
    # The first step searches the question; the later ones its topic alone.
    assert retriever.queries == ["Tell me about Normandy."] + ["Normandy"] * (1 + MAX_MISSES)
    # A later step's evidence drafts continue the answer so far and may not end at once.
    drafted = [(b.passage.id if b.passage else None, b.min_tokens) for b in critic.drafted_branches]
    assert drafted[0] == ("n1", 0)
    assert {m for p, m in drafted[1:] if p is not None} == {1}
    assert {m for p, m in drafted if p is None} <= {0}


def test_eos_stops_decoding():
    critic = ScriptedCritic(drafts={"p1": (" Done.", -1.0, "eos"), None: (" x.", -9.0, "eos")})
    decoder, _ = make(critic, PASSAGES[:1])
    out = decoder.answer("q", cfg(max_segments=5))
    assert len(out.segments) == 1 and out.usage.steps == 1


def test_max_retrievals_budget():
    critic = ScriptedCritic(
        drafts={"p1": (" Part.", -1.0, "sentence"), None: (" y.", -9, "sentence")}
    )
    decoder, retriever = make(critic, PASSAGES[:1])
    out = decoder.answer(
        LISTED,
        cfg(max_segments=3, max_retrievals=1, keep_unsupported_segments=True, min_novelty=0.0),
    )
    assert len(retriever.queries) == 1
    assert out.usage.retrievals == 1
    assert out.segments[1].citation is None and not out.segments[1].retrieved


def test_an_answer_that_retrieved_ends_when_its_retrievals_are_spent():
    critic = ScriptedCritic(drafts={"p1": (" Part one.", -1.0, "eos"), None: (" y.", -9, "eos")})
    decoder, retriever = make(critic, PASSAGES[:1])
    out = decoder.answer("Tell me about Normandy.", cfg(max_segments=6, max_retrievals=1))
    # A later segment could only cite nothing, which is dropped: no step is drafted for it.
    assert out.usage.steps == 1 and len(retriever.queries) == 1
    assert [s.citation.passage_id for s in out.segments] == ["p1"]


def test_prefill_budget_stops_early():
    critic = ScriptedCritic(drafts={"p1": (" Part.", -1.0, "sentence")})
    decoder, _ = make(critic, PASSAGES[:1])
    out = decoder.answer(LISTED, cfg(max_segments=5, max_prefill_tokens=50, min_novelty=0.0))
    assert out.usage.stopped_by == "max_prefill_tokens"
    assert len(out.segments) == 1


def test_timeout_budget_stops_before_next_step():
    ticks = iter(range(0, 1000, 10))
    critic = ScriptedCritic(drafts={"p1": (" Part.", -1.0, "sentence")})
    decoder, _ = make(critic, PASSAGES[:1], clock=lambda: float(next(ticks)))
    out = decoder.answer(LISTED, cfg(max_segments=5, timeout_s=1.0, min_novelty=0.0))
    assert out.usage.stopped_by == "timeout_s"
    assert out.answer  # never empty


def test_beam_keeps_best_cumulative_hypotheses():
    critic = ScriptedCritic(
        relevance_of={"p1": 0.9, "p2": 0.9},
        drafts={
            "p1": (" One.", -1.0, "sentence"),
            "p2": (" Two.", -1.2, "sentence"),
            None: (" Three.", -8.0, "sentence"),
        },
    )
    decoder, _ = make(critic, PASSAGES[:2])
    out = decoder.answer(
        LISTED, cfg(beam=2, max_segments=2, min_novelty=0.0, w_new=0.0, diverse_passages=False)
    )
    assert len(out.segments) == 2
    assert out.answer == "One. One."
    # Two hypotheses expanded at step 2: 2 x (2 passages + 1 no-retrieval) branches.
    assert out.usage.branches_opened == 3 + 6


def test_empty_drafts_never_give_an_empty_answer():
    critic = ScriptedCritic(drafts={"p1": ("  ", -1.0, "eos"), None: ("", -1.0, "eos")})
    decoder, _ = make(critic, PASSAGES[:1])
    out = decoder.answer("q", cfg())
    assert out.answer.strip()
    assert out.abstained


def norman_then_rollo(p1_support: float) -> BeamDecoder:
    """A decoder over two passages: p1 drafts "Norman people." with support `p1_support`, p2,
    read more relevant, drafts a fully supported "Rollo."."""
    critic = ScriptedCritic(
        relevance_of={"p1": 0.6, "p2": 0.8},
        drafts={"p1": (" Norman people.", -0.5, "eos"), "p2": (" Rollo.", -0.5, "eos")},
        support_of={
            "p1": {"full": p1_support, "none": 1 - p1_support},
            "p2": {"full": 0.9, "none": 0.1},
        },
    )
    return make(critic, PASSAGES[:2])[0]


def test_by_default_a_more_relevant_passage_answers_where_the_first_failed():
    decoder = norman_then_rollo(0.1)
    config = settle_filters(
        DecodingConfig(mode="always", max_segments=1, min_support_score=0.5), "scripted"
    )
    assert decoder.answer("q", config.model_copy(update={"retry_drafts": 0})).abstained
    out = decoder.answer("q", config)  # by default one more passage drafts: p2
    assert out.answer == "Rollo." and out.segments[0].citation.passage_id == "p2"
    assert out.support == pytest.approx(0.9)


def test_with_retry_flagged_a_more_relevant_passage_answers_where_the_first_was_flagged():
    # No support threshold: p1's draft answers, but would be flagged low support; p2 reads more
    # relevant, drafts, and its fully supported draft ranks first.
    decoder = norman_then_rollo(0.3)
    config = settle_filters(DecodingConfig(mode="always", max_segments=1), "scripted")
    out = decoder.answer("q", config)  # off by default
    assert out.answer == "Norman people." and out.segments[0].flags == ["low_support"]
    out = decoder.answer("q", config.model_copy(update={"retry_flagged": True}))
    assert out.answer == "Rollo." and out.segments[0].citation.passage_id == "p2"
    assert out.segments[0].flags == []


def test_an_account_step_keeps_a_segment_from_each_passage_that_adds_something():
    passages = [
        Passage("n1", "Normandy is a region of France.", "Normandy", 0.9),
        Passage("n2", "Vikings settled Normandy in 911.", "Normandy", 0.8),
        Passage("n3", "Normandy is a region of France.", "Normandy", 0.7),
    ]
    critic = ScriptedCritic(
        relevance_of={"n1": 0.9, "n2": 0.8, "n3": 0.7},
        drafts={
            "n1": (" Normandy is a region.", -1.0, "eos"),
            "n2": (" Vikings settled there.", -1.0, "eos"),
            "n3": (" Normandy is a region.", -1.0, "eos"),
        },
    )
    decoder, _ = make(critic, passages)
    settings = {"max_segments": 6, "max_drafts": 1, "segments_per_step": 3}
    out = decoder.answer("Tell me about Normandy.", cfg(**settings))
    # Its first step drafts all three passages (max_drafts is raised to segments_per_step),
    # with the no-retrieval branch, and keeps n1's and n2's segments; n3's says what n1's did.
    assert [s.citation.passage_id for s in out.segments] == ["n1", "n2"]
    assert critic.calls[2] == "draft:4"
    one = ScriptedCritic(relevance_of=critic.relevance_of, drafts=critic.drafts)
    decoder, _ = make(one, passages)
    single = decoder.answer("Where is Normandy?", cfg(**settings))
    assert [s.citation.passage_id for s in single.segments] == ["n1"]  # one thing asked
    assert "draft:4" not in one.calls


def test_an_answer_stops_at_its_token_budget_and_its_last_draft_is_cut_to_fit():
    facts = [" Rollo founded it.", " Vikings settled there.", " Caen is its capital."]
    passages = [Passage(f"n{i}", t, "Normandy", 0.9 - i / 10) for i, t in enumerate(facts)]
    critic = ScriptedCritic(drafts={f"n{i}": (t, -1.0, "eos") for i, t in enumerate(facts)})
    decoder, _ = make(critic, passages)
    out = decoder.answer(
        "Tell me about Normandy.", cfg(max_segments=6, top_k=1, max_answer_tokens=8)
    )
    # Three words a draft: two fit, the third is drafted with the two tokens left (cut
    # mid-sentence), and the budget spent ends the answer.
    assert [s.n_tokens for s in out.segments] == [3, 3, 2]
    assert critic.draft_budgets[-1] == 2 and out.usage.steps == 3
