"""pipeline/grounding.py: the numbers and names a segment states, found or not in its evidence,
and its words found together in one sentence."""

from selfrag.pipeline.grounding import (
    grounding_score,
    key_terms,
    missing_terms,
    sentence_share,
    term_share,
    word_share,
)

PASSAGE = (
    "The Normans were descended from Norse raiders under their leader Rollo, who agreed to "
    "swear fealty to King Charles III of West Francia in 911. By 1,200 the duchy was rich."
)


def test_key_terms_are_numbers_and_names_not_sentence_starts_or_function_words():
    terms = key_terms("The leader was Rollo. In 911 he met Charles III of West Francia.")
    assert terms == ["911", "Rollo", "Charles", "III", "West", "Francia"]


def test_a_segment_copied_from_its_passage_misses_nothing():
    segment = "The Norse raiders' leader was Rollo, in 911."
    assert missing_terms(segment, PASSAGE) == []
    assert sentence_share(segment, PASSAGE) == 1.0
    assert grounding_score(segment, PASSAGE, "Who led the Norse raiders?") == 1.0


def test_words_no_one_sentence_holds_lower_the_score():
    # "founded" is nowhere in the passage, "rich" and "duchy" are in another sentence.
    segment = "The Norse leader Rollo founded a rich duchy."
    assert sentence_share(segment, PASSAGE) == 3 / 6
    assert grounding_score(segment, PASSAGE) == 3 / 6


def test_a_question_word_the_sentence_lacks_counts_half():
    segment = "The Norse leader who founded Normandy was Rollo."
    # norse, leader, rollo held; founded and normandy only asked: (3 + 2 / 2) of 5.
    assert sentence_share(segment, PASSAGE, "Who founded Normandy?") == 4 / 5
    assert sentence_share(segment, PASSAGE) == 3 / 5


def test_a_segment_put_together_from_two_sentences_is_not_one_sentence_s_claim():
    evidence = "Rollo led the Norse raiders.\nThe duchy grew rich by 1200."
    assert sentence_share("Rollo grew rich.", evidence) == 2 / 3
    assert sentence_share("Rollo led the raiders.", evidence) == 1.0


def test_an_invented_name_or_number_is_missing():
    segment = "It was founded by Hastein in 876 at Rouen."
    assert missing_terms(segment, PASSAGE) == ["876", "Hastein", "Rouen"]
    assert term_share(segment, PASSAGE) == 0.0
    assert term_share("It was Rollo in 876.", PASSAGE) == 0.5
    assert grounding_score(segment, PASSAGE) == 0.0


def test_a_name_repeated_from_the_question_is_missing_where_the_passage_lacks_it():
    # The question asks about Illinois; the passage is about Indiana: the draft answers a
    # question its passage does not.
    passage = "Juliet Peddle was the first woman architect licensed by the state of Indiana."
    question = "Who was the first woman architect licensed by the state of Illinois?"
    segment = "Juliet Peddle was the first woman architect licensed by the state of Illinois."
    assert missing_terms(segment, passage) == ["Illinois"]
    assert term_share(segment, passage) == 1 / 2  # Peddle found, Illinois not
    assert grounding_score(segment, passage, question) < grounding_score(
        segment.replace("Illinois", "Indiana"), passage, question
    )
    assert missing_terms("Rollo founded Normandy.", PASSAGE) == ["Normandy"]


def test_a_name_is_found_in_its_plural_not_inside_a_longer_word():
    assert missing_terms("The word Norman means Northman.", "The Normans were Northmen.") == [
        "Northman"
    ]
    assert missing_terms("Rollo led the Normand.", "Rollo of Normandy.") == ["Normand"]
    assert missing_terms("The Church stood there.", "Two churches stood.") == []  # "-es"


def test_thousands_separators_accents_and_possessives_are_one_form():
    assert missing_terms("By 1200 it was rich.", PASSAGE) == []
    assert missing_terms("Rollo's men came from Zürich.", "Rollo came from Zurich.") == []


def test_a_hyphenated_name_is_found_whole_and_not_inside_a_longer_word():
    passage = "The treaty of Saint-Clair-sur-Epte was signed by Rollo."
    assert missing_terms("Rollo signed at Saint-Clair-sur-Epte.", passage) == []
    assert missing_terms("It was at Clair.", passage) == []  # a part of the name
    assert missing_terms("Rollo signed at Saint-Denis.", passage) == ["Saint-Denis"]
    assert missing_terms("The Rol signed.", passage) == ["Rol"]


def test_a_segment_stating_no_key_term_is_scored_by_its_sentence_share_alone():
    assert grounding_score("it was rich and large.", PASSAGE) == 0.5  # "rich" of rich, large
    assert grounding_score("it was so.", PASSAGE) is None  # no name, number or content word
    assert sentence_share("", PASSAGE) is None


def test_a_script_without_spaces_is_left_to_the_key_terms():
    evidence = "诺曼人是维京人的后裔。他们的首领罗洛在911年与法王签约。"
    assert sentence_share("首领是罗洛。", evidence) is None
    assert grounding_score("罗洛在911年签约。", evidence) == 1.0  # 911 found: the key terms alone
    assert grounding_score("罗洛在876年签约。", evidence) == 0.0


def test_identifiers_are_key_terms_and_prose_abbreviations_are_not():
    segment = (
        "Set `retry_drafts`, pass --top-k or selfrag-index=true, edit config.toml and "
        "deploy/selfrag.json, call /healthz, e.g. in the U.S., and/or at 3.5 GHz."
    )
    terms = key_terms(segment)
    for identifier in (
        "retry_drafts",
        "--top-k",
        "selfrag-index=true",
        "config.toml",
        "deploy/selfrag.json",
        "/healthz",
    ):
        assert identifier in terms
    # Abbreviations and words joined by a slash are prose; a number stays a number.
    assert not {"e.g", "e.g.", "U.S", "U.S.", "and/or"} & set(terms)
    assert "3.5" in terms


def test_an_invented_identifier_is_missing_and_a_copied_one_is_found():
    passage = "Run `selfrag index --no-calibrate` to skip it; the file is SELFRAG_HOME/config.toml."
    assert missing_terms("Pass --no-calibrate to selfrag index.", passage) == []
    assert missing_terms("It reads config.toml.", passage) == []
    assert missing_terms("Pass --skip-calibration.", passage) == ["--skip-calibration"]
    assert missing_terms("It reads settings.yaml.", passage) == ["settings.yaml"]
    assert missing_terms("Set retry_budget.", passage) == ["retry_budget"]


def test_word_share_counts_content_words_found_anywhere_in_the_evidence():
    # Content words: rollo, swore, fealty, charles, west, francia: all but "swore" (the
    # passage has "swear") are found, in different sentences.
    assert word_share("Rollo swore fealty to Charles of West Francia.", PASSAGE) == 5 / 6
    assert word_share("It is.", PASSAGE) is None
    assert word_share("ロロはノルマンディーを", PASSAGE) is None
