import pytest

from selfrag.pipeline.coverage import (
    MAX_MISSES,
    QuestionPlan,
    about_topic,
    branch_question,
    plan_question,
    search_query,
    settle,
    split_parts,
)
from selfrag.pipeline.protocols import Passage
from selfrag.pipeline.ranking import Hypothesis
from selfrag.schemas.answer import Citation, SegmentOut
from selfrag.schemas.decoding import DecodingConfig


def segment(text: str, passage: str | None = "p1") -> SegmentOut:
    citation = Citation(passage_id=passage) if passage else None
    return SegmentOut(
        text=text, citation=citation, retrieved=True, logprob=-1.0, n_tokens=3, score=1.0
    )


@pytest.mark.parametrize(
    "question",
    [
        "Who was the Norse leader who founded Normandy?",
        "In computational complexity theory, what is the term for the abstract question?",
        "If two integers are multiplied, what is this expression set called?",
        "What is the default data folder, SELFRAG_HOME, when none is set?",
        "Besides `Authorization: Bearer`, which header can carry an API key?",
        "Who ruled when the war began?",
        "Which ship was built in 1941 and sank in 1944?",
    ],
)
def test_a_question_asking_one_thing_has_no_parts(question):
    plan = plan_question(question)
    assert plan.parts == () and not plan.open_ended and not plan.long


@pytest.mark.parametrize(
    ("question", "parts"),
    [
        (
            "Where is Coronation Park, when was the 1911 Durbar held there, and which king "
            "was crowned there?",
            [
                "Where is Coronation Park",
                "When was the 1911 Durbar held there",
                "Which king was crowned there",
            ],
        ),
        (
            "Who founded Al-Qaeda and when did it carry out the attacks?",
            ["Who founded Al-Qaeda", "When did it carry out the attacks"],
        ),
        ("What is the capital of France? What is its population?", None),
        (
            "When and where was Andrew Carnegie born?",
            ["When was Andrew Carnegie born", "Where was Andrew Carnegie born"],
        ),
        (
            "In 1962, who wrote the paper and what did it prove?",
            ["In 1962, who wrote the paper", "What did it prove"],
        ),
        (
            "What year did the war start, who won it, and where was the treaty signed?",
            ["What year did the war start", "Who won it", "Where was the treaty signed"],
        ),
        (
            "Who built the dam, which 1930s law funded its second tunnel, and in which "
            "town was its architect born?",
            [
                "Who built the dam",
                "Which 1930s law funded its second tunnel",
                "In which town was its architect born",
            ],
        ),
        (
            "How long is the canal, which pumping station of the Erie–Hudson line "
            "was rebuilt, and how wide is it?",
            [
                "How long is the canal",
                "Which pumping station of the Erie–Hudson line was rebuilt",
                "How wide is it",
            ],
        ),
        (
            "When a nightly job fails on some rows, how do I rerun those, and which "
            "`retry` value keeps them?",
            [
                "When a nightly job fails on some rows, how do I rerun those",
                "Which `retry` value keeps them",
            ],
        ),
        (
            "While the server runs: where do logs go, and at whose request was it started?",
            ["While the server runs: where do logs go", "At whose request was it started"],
        ),
        (
            "Tell me about the 5th Squadron: when it first flew, which airfield it built, "
            "and its first aircraft type?",
            ["When it first flew", "Which airfield it built", "Its first aircraft type"],
        ),
    ],
)
def test_a_question_listing_parts_is_cut_into_them(question, parts):
    plan = plan_question(question)
    assert plan.long and not plan.open_ended
    if parts is None:
        assert len(plan.parts) == 2
    else:
        assert list(plan.parts) == parts


def test_a_topic_with_a_list_has_its_parts_each_naming_the_topic():
    plan = plan_question(
        "Tell me about Coronation Park in Delhi: where it is, when the Delhi Durbar was held "
        "there, and which statues stand in it."
    )
    assert plan.topic == "Coronation Park in Delhi"
    assert plan.parts == (
        "Where it is",
        "When the Delhi Durbar was held there",
        "Which statues stand in it",
    )
    assert plan.part_question(1) == (
        "When the Delhi Durbar was held there (Coronation Park in Delhi)?"
    )


@pytest.mark.parametrize(
    ("question", "topic"),
    [
        ("Tell me about Andrew Carnegie.", "Andrew Carnegie"),
        ("Tell me a bio of Alexander Fleming", "Alexander Fleming"),
        ("Could you describe the Battle of Island Number Ten?", "the Battle of Island Number Ten"),
        ("Give me an overview of antimicrobial resistance.", "antimicrobial resistance"),
    ],
)
def test_an_account_of_a_topic_is_open_ended(question, topic):
    plan = plan_question(question)
    assert plan.open_ended and plan.long and plan.parts == () and plan.topic == topic


def test_a_later_part_borrows_the_first_parts_names_only_when_it_lacks_them():
    plan = plan_question("Who founded Al-Qaeda and when did it carry out the attacks?")
    assert plan.part_question(0) == "Who founded Al-Qaeda?"
    assert plan.part_question(1) == "When did it carry out the attacks (Al-Qaeda)?"
    plan = plan_question("Who founded Al-Qaeda and when did Al-Qaeda attack?")
    assert plan.part_question(1) == "When did Al-Qaeda attack?"


def test_wh_words_alone_are_not_parts_of_their_own():
    assert split_parts("when and where") == ["When and where"]


LISTED = plan_question("Who founded Rome, when was it founded, and where did its founders live?")
SHORT = plan_question("Who founded Rome?")
OPEN = plan_question("Tell me about Rome.")


def test_a_short_question_is_done_after_its_first_step():
    answered = settle(SHORT, Hypothesis(segments=(segment(" Romulus."),), part=1))
    assert answered.done and not answered.abstained
    missed = settle(SHORT, Hypothesis(part=1, misses=1))
    assert missed.done and missed.abstained


def test_a_segment_cut_mid_sentence_goes_on():
    h = settle(SHORT, Hypothesis(segments=(segment(" Romulus and"),), cut=True))
    assert not h.done


def test_a_short_answer_is_continued_once_a_long_one_while_cut():
    twice = (segment(" Romulus and"), segment(" Remus, twins raised by"))
    assert settle(SHORT, Hypothesis(segments=twice, cut=True)).done
    assert not settle(LISTED, Hypothesis(segments=twice, cut=True)).done


def test_a_listed_question_is_done_once_every_part_had_its_step():
    one = Hypothesis(segments=(segment(" Romulus."),), part=1)
    assert not settle(LISTED, one).done
    # A part whose step failed is dropped: the answer goes on to the next.
    missed = Hypothesis(segments=(segment(" Romulus."),), part=2, misses=1)
    assert not settle(LISTED, missed).done
    assert settle(LISTED, Hypothesis(segments=(segment(" Romulus."),), part=3)).done
    nothing = settle(LISTED, Hypothesis(part=3, misses=3))
    assert nothing.done and nothing.abstained


def test_an_open_account_ends_after_misses_in_a_row():
    h = Hypothesis(segments=(segment(" Rome is a city."),), part=1, misses=MAX_MISSES - 1)
    assert not settle(OPEN, h).done
    assert settle(OPEN, Hypothesis(segments=h.segments, misses=MAX_MISSES)).done


def test_ranking_marks_done_at_max_segments_and_the_stop_rule_keeps_it():
    h = Hypothesis(segments=(segment(" Romulus."),), part=1, done=True)
    assert settle(LISTED, h).done


@pytest.mark.parametrize(
    ("strategy", "first", "second"),
    [
        ("part", "Who founded Rome?", "When was it founded (Rome)?"),
        (
            "missing",
            "Rome Who founded Rome When was it founded Where did its founders live",
            "Rome When was it founded Where did its founders live",
        ),
        (
            "answer",
            "Who founded Rome, when was it founded, and where did its founders live?",
            "Who founded Rome, when was it founded, and where did its founders live? Romulus.",
        ),
    ],
)
def test_each_step_of_a_listed_question_searches_for_what_is_missing(strategy, first, second):
    cfg = DecodingConfig(segment_retrieval=strategy)
    assert search_query(LISTED, Hypothesis(), cfg) == first
    after = Hypothesis(segments=(segment(" Romulus."),), part=1)
    assert search_query(LISTED, after, cfg) == second


def test_a_short_or_open_question_searches_the_question_then_with_a_cut_answer_or_topic():
    cfg = DecodingConfig()
    assert search_query(SHORT, Hypothesis(), cfg) == "Who founded Rome?"
    cut = Hypothesis(segments=(segment(" Romulus and"),), cut=True)
    assert search_query(SHORT, cut, cfg) == "Who founded Rome? Romulus and"
    assert search_query(OPEN, Hypothesis(), cfg) == "Tell me about Rome."
    # Past its first segment an account searches its topic, without the lead-in.
    later = Hypothesis(segments=(segment(" Rome is a city."),), part=1)
    assert search_query(OPEN, later, cfg) == "Rome"
    missing = DecodingConfig(segment_retrieval="missing")
    assert search_query(OPEN, later, missing) == "Rome"
    answer = DecodingConfig(segment_retrieval="answer")
    assert search_query(OPEN, later, answer) == "Tell me about Rome. Rome is a city."
    static = DecodingConfig(segment_retrieval="static")
    assert search_query(OPEN, later, static) == "Tell me about Rome."


def test_each_step_drafts_on_the_part_it_answers():
    assert branch_question(LISTED, Hypothesis(part=1)) == "When was it founded (Rome)?"
    assert branch_question(OPEN, Hypothesis(part=1)) == "Tell me about Rome."
    assert branch_question(QuestionPlan("q"), Hypothesis()) == "q"


def test_an_account_draws_on_passages_about_its_topic():
    plan = plan_question("Tell me about Robert Surcouf.")
    article = Passage("1", "Surcouf found two merchantmen.", "Robert Surcouf")
    elsewhere = Passage("2", "Robert Guiscard led the Normans.", "Normans")
    named = Passage("3", "Robert Surcouf was born in 1773.", "Privateers")
    assert about_topic(plan, article) and about_topic(plan, named)
    assert not about_topic(plan, elsewhere)
    assert about_topic(LISTED, elsewhere)  # only an open account is held to its topic
