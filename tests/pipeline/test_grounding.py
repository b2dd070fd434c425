"""pipeline/grounding.py: the numbers and names a segment states, found or not in its evidence."""

from selfrag.pipeline.grounding import grounding_score, key_terms, missing_terms

PASSAGE = (
    "The Normans were descended from Norse raiders under their leader Rollo, who agreed to "
    "swear fealty to King Charles III of West Francia in 911. By 1,200 the duchy was rich."
)


def test_key_terms_are_numbers_and_names_not_sentence_starts_or_function_words():
    terms = key_terms("The leader was Rollo. In 911 he met Charles III of West Francia.")
    assert terms == ["911", "Rollo", "Charles", "III", "West", "Francia"]


def test_a_segment_copied_from_its_passage_misses_nothing():
    segment = "The Norse leader who founded Normandy was Rollo, in 911."
    assert missing_terms(segment, PASSAGE, "Who founded Normandy?") == []
    assert grounding_score(segment, PASSAGE, "Who founded Normandy?") == 1.0


def test_an_invented_name_or_number_is_missing():
    segment = "It was founded by Hastein in 876 at Rouen."
    assert missing_terms(segment, PASSAGE) == ["876", "Hastein", "Rouen"]
    assert grounding_score(segment, PASSAGE) == 0.0


def test_the_question_s_own_names_count_as_shown():
    segment = "Rollo founded Normandy."
    assert missing_terms(segment, PASSAGE, "Who founded Normandy?") == []
    assert missing_terms(segment, PASSAGE, "") == ["Normandy"]


def test_thousands_separators_accents_and_possessives_are_one_form():
    assert missing_terms("By 1200 it was rich.", PASSAGE) == []
    assert missing_terms("Rollo's men came from Zürich.", "Rollo came from Zurich.") == []


def test_a_segment_stating_no_key_term_has_no_score():
    assert grounding_score("it was rich and large.", PASSAGE) is None
