"""Training examples for the reflection heads, on a small hand-written corpus."""

from __future__ import annotations

import random
import re

import pytest

from selfrag.pipeline.critics import Branch
from selfrag.pipeline.learning.reflection_data import (
    EntityPool,
    Example,
    inverse_cloze,
    qa_draft_examples,
    qa_relevance_examples,
    retrieve_examples,
    sentences,
    support_examples,
    topic_question,
    utility_examples,
)
from selfrag.pipeline.protocols import Passage

NORMANS = Passage(
    "n1",
    "The Normans settled in northern France during the tenth century. "
    "Their leader was the Viking chief Rollo who swore fealty in 911. "
    "The duchy was later ruled by William of Normandy from 1035 onward. "
    "His army had about 7000 soldiers when it crossed the sea in 1066. "
    "The descendants of the settlers spread across Europe and founded kingdoms.",
    "Normans",
)
DANUBE = Passage(
    "d1",
    "The river flows through ten countries before reaching the Black Sea. "
    "It is about 2850 kilometres long and drains a very large basin. "
    "The river was a frontier of the Roman Empire for four centuries. "
    "Cities such as Vienna and Budapest grew along its banks over time. "
    "Ships have carried grain along the river since at least 1830.",
    "Danube",
)
CURIE = Passage(
    "c1",
    "The physicist was born in Warsaw in 1867 to a family of teachers. "
    "She moved to Paris and studied physics at the university in 1891. "
    "Together with her husband she discovered two new elements in 1898. "
    "She received the prize for physics in 1903 and chemistry later on. "
    "Her laboratory employed 12 assistants at the height of its work.",
    "Marie Curie",
)
EVEREST = Passage(
    "e1",
    "The mountain rises 8849 metres above sea level on the border of Nepal. "
    "The first confirmed ascent was made by Tenzing Norgay and a partner in 1953. "
    "Climbers usually attempt the summit in spring when the winds are weaker. "
    "More than 300 people have died on the mountain since records began. "
    "The peak was named after George Everest by the survey in 1865.",
    "Mount Everest",
)
SHORT = Passage("s1", "Too short. Only two sentences here, which is not enough.", "Short")
CORPUS = [NORMANS, DANUBE, CURIE, EVEREST]


def pool() -> EntityPool:
    return EntityPool.from_texts([p.text for p in CORPUS])


def one_swap_of(original: str, swapped: str, entities: EntityPool) -> tuple[str, str, str]:
    """The (kind, old, new) of the single same-kind replacement that turns `original` into
    `swapped`; fails unless there is exactly one."""
    found = set()
    for kind, values in entities.kinds.items():
        for old in values:
            for m in re.finditer(re.escape(old), original):
                for new in values:
                    if new != old and original[: m.start()] + new + original[m.end() :] == swapped:
                        found.add((kind, old, new))
    assert len(found) == 1, (original, swapped, found)
    return found.pop()


# --- sentences and entities ---------------------------------------------------------------------


def test_sentences_split_at_sentence_ends_and_drop_short_ones() -> None:
    got = sentences(NORMANS.text)
    assert len(got) == 5
    assert got[1] == "Their leader was the Viking chief Rollo who swore fealty in 911."
    assert sentences(
        "Too short. Five words are not enough. But these six words are just enough."
    ) == ["But these six words are just enough."]
    assert sentences("") == []


def test_entity_pool_collects_years_numbers_and_names_by_kind() -> None:
    p = pool()
    assert {"1035", "1066", "1830", "1867", "1953"} <= set(p.kinds["year"])
    # Years are four digits (1000-2099): a three-digit year such as 911 counts as a number.
    assert {"911", "7000", "2850", "12", "8849", "300"} <= set(p.kinds["number"])
    assert not set(p.kinds["year"]) & set(p.kinds["number"])
    assert {"Rollo", "William of Normandy", "Vienna", "Warsaw", "Nepal"} <= set(p.kinds["name"])
    # A capitalised word that starts a sentence is not taken for a name.
    assert "Their" not in p.kinds["name"] and "Climbers" not in p.kinds["name"]
    assert len(p.kinds["year"]) == len(set(p.kinds["year"]))


@pytest.mark.parametrize(
    ("sentence", "kind", "old"),
    [
        ("The fleet sailed across the sea in 1066 with many ships.", "year", "1066"),
        ("The army had about 7000 soldiers and many horses too.", "number", "7000"),
        ("The duchy was later ruled by William of Normandy alone.", "name", "William of Normandy"),
    ],
)
def test_replace_one_swaps_one_entity_for_another_of_its_kind(
    sentence: str, kind: str, old: str
) -> None:
    entities = pool()
    for seed in range(5):
        swapped = entities.replace_one(sentence, random.Random(seed))
        assert swapped is not None and swapped != sentence
        got_kind, got_old, new = one_swap_of(sentence, swapped, entities)
        assert (got_kind, got_old) == (kind, old)
        assert new in entities.kinds[kind]


def test_replace_one_changes_exactly_one_entity_of_a_sentence_with_several() -> None:
    entities = pool()
    sentence = sentences(NORMANS.text)[3]  # a number (7000) and a year (1066)
    kinds = set()
    for seed in range(20):
        swapped = entities.replace_one(sentence, random.Random(seed))
        assert swapped is not None
        kinds.add(one_swap_of(sentence, swapped, entities)[0])
    assert kinds == {"number", "year"}


def test_replace_one_returns_none_when_nothing_can_be_swapped() -> None:
    entities = pool()
    rng = random.Random(0)
    assert entities.replace_one("the quiet river runs slowly through green fields.", rng) is None
    # The only year of a corpus has no other year to become.
    single = EntityPool.from_texts(["It was built in 1999 by the town council."])
    assert single.replace_one("It was rebuilt in 1999 after the great fire.", rng) is None
    # Every other year of the pool already occurs in the sentence.
    pair = EntityPool.from_texts(["It happened in 1999.", "It ended in 2001."])
    assert pair.replace_one("Between 1999 and 2001 the town grew fast.", rng) is None


# --- self-supervised examples ---------------------------------------------------------------------


def test_inverse_cloze_pairs_a_sentence_with_the_rest_of_its_passage_and_a_hard_negative() -> None:
    calls: list[tuple[str, str]] = []

    def hard_negative(query: str, own: Passage) -> Passage | None:
        calls.append((query, own.id))
        return next(p for p in CORPUS if p.id != own.id)

    examples = inverse_cloze([*CORPUS, SHORT], random.Random(0), hard_negative)
    assert len(examples) == 2 * len(CORPUS)  # SHORT has too few sentences
    assert [c[1] for c in calls] == [p.id for p in CORPUS]
    by_key = {p.id: p for p in CORPUS}
    for relevant, irrelevant in zip(examples[::2], examples[1::2], strict=True):
        own = by_key[relevant.key]
        query = relevant.branch.question
        assert (relevant.group, relevant.label, relevant.source) == ("relevance", "relevant", "ict")
        assert query in sentences(own.text)
        rest = relevant.branch.passage
        assert rest is not None and rest.id == own.id and rest.title == own.title
        assert query not in rest.text
        assert sorted([*sentences(rest.text), query]) == sorted(sentences(own.text))
        assert relevant.branch.prefix == "" and relevant.answer == ""
        assert (irrelevant.group, irrelevant.label) == ("relevance", "irrelevant")
        assert irrelevant.branch.question == query and irrelevant.key == own.id
        assert irrelevant.branch.passage is not None and irrelevant.branch.passage.id != own.id
    assert [q for q, _ in calls] == [e.branch.question for e in examples[::2]]


def test_inverse_cloze_without_a_hard_negative_gives_only_relevant_pairs() -> None:
    examples = inverse_cloze(CORPUS, random.Random(0), lambda query, own: None)
    assert len(examples) == len(CORPUS)
    assert {e.label for e in examples} == {"relevant"}


def test_support_examples_are_full_none_and_partial() -> None:
    entities = pool()
    examples = support_examples(CORPUS, CORPUS, random.Random(0), entities)
    assert len(examples) == 3 * len(CORPUS)
    by_key = {p.id: p for p in CORPUS}
    for full, none, partial in zip(examples[::3], examples[1::3], examples[2::3], strict=True):
        p = by_key[full.key]
        assert [e.label for e in (full, none, partial)] == ["full", "none", "partial"]
        assert {e.group for e in (full, none, partial)} == {"support"}
        assert [e.source for e in (full, none, partial)] == ["sentence", "swap", "blend"]
        for e in (full, none, partial):
            assert e.branch.passage == p and e.branch.question == topic_question(p)
            assert e.key == p.id
        assert full.answer in sentences(p.text)
        assert none.answer != full.answer and none.answer not in p.text
        one_swap_of(full.answer, none.answer, entities)
        assert partial.answer.startswith(full.answer + " ")
        foreign = partial.answer[len(full.answer) + 1 :]
        assert foreign not in p.text
        assert any(foreign in sentences(q.text) for q in CORPUS if q.id != p.id)


def test_support_examples_skip_a_passage_without_swappable_entities() -> None:
    plain = Passage(
        "x1",
        "the river runs slowly through the green fields. it is quiet there in the evening. "
        "many birds nest along the banks of the river.",
        "River",
    )
    assert support_examples([plain], CORPUS, random.Random(0), pool()) == []


def test_topic_question() -> None:
    assert topic_question(NORMANS) == "What is known about Normans?"
    assert topic_question(Passage("u", "Text.")) == "What does this text say?"


def test_utility_examples_rate_own_sentences_5_and_foreign_ones_1() -> None:
    examples = utility_examples(CORPUS, CORPUS, random.Random(0))
    assert len(examples) == 2 * len(CORPUS)
    by_key = {p.id: p for p in CORPUS}
    for good, bad in zip(examples[::2], examples[1::2], strict=True):
        p = by_key[good.key]
        assert (good.group, good.label, bad.group, bad.label) == ("utility", "5", "utility", "1")
        # IsUse is read without the passage in view.
        assert good.branch.passage is None and bad.branch.passage is None
        assert good.branch.question == bad.branch.question == topic_question(p)
        assert good.answer in sentences(p.text)
        assert bad.answer not in p.text
    # With no other passage to take a sentence from, there is no pair.
    assert utility_examples([NORMANS], [NORMANS], random.Random(0)) == []


def test_retrieve_examples_say_yes_before_an_answer_and_no_after_one() -> None:
    examples = retrieve_examples([*CORPUS, Passage("z", "Tiny.", "Tiny")], random.Random(0))
    assert len(examples) == 2 * len(CORPUS)
    by_key = {p.id: p for p in CORPUS}
    for yes, no in zip(examples[::2], examples[1::2], strict=True):
        p = by_key[yes.key]
        assert (yes.group, yes.label, no.group, no.label) == ("retrieve", "yes", "retrieve", "no")
        assert yes.branch == Branch(topic_question(p), "", None)
        assert no.branch.passage is None and no.branch.prefix in sentences(p.text)


# --- labelled QA --------------------------------------------------------------------------------


def test_qa_relevance_labels_passages_by_whether_they_hold_a_gold_answer() -> None:
    examples = qa_relevance_examples("q1", "Who led the Normans?", ["Rollo"], [NORMANS, DANUBE])
    assert [(e.group, e.label) for e in examples] == [
        ("relevance", "relevant"),
        ("relevance", "irrelevant"),
    ]
    assert [e.branch.passage for e in examples] == [NORMANS, DANUBE]
    assert all(e.key == "q1" and e.source == "qa" for e in examples)
    assert all(e.branch.question == "Who led the Normans?" for e in examples)


def labels(examples: list[Example]) -> list[tuple[str, str]]:
    return [(e.group, e.label) for e in examples]


def test_qa_drafts_with_a_gold_answer_are_supported_and_useful() -> None:
    q = "Who led the Normans?"
    examples = qa_draft_examples("q1", q, ["Rollo"], True, NORMANS, "It was Rollo, a Viking.")
    assert labels(examples) == [("support", "full"), ("utility", "5"), ("retrieve", "yes")]
    support, utility, retrieve = examples
    assert support.branch.passage == NORMANS and support.answer == "It was Rollo, a Viking."
    assert utility.branch == support.branch and utility.answer == support.answer
    assert retrieve.branch == Branch(q, "", None) and retrieve.answer == ""
    assert {e.key for e in examples} == {"q1"}


def test_qa_wrong_and_unanswerable_drafts_are_unsupported_and_useless() -> None:
    q = "Who led the Normans?"
    wrong = qa_draft_examples("q1", q, ["Rollo"], True, NORMANS, "It was William.")
    assert labels(wrong) == [("support", "none"), ("utility", "1")]
    assert {e.source for e in wrong} == {"qa-wrong"}
    # An unanswerable question: any answer is unsupported, even one naming a "gold" string.
    trap = qa_draft_examples("q2", q, ["Rollo"], False, NORMANS, "It was Rollo.")
    assert labels(trap) == [("support", "none"), ("utility", "1")]
    assert {e.source for e in trap} == {"qa-unanswerable"}
    assert trap[0].branch.passage == NORMANS and trap[1].branch == trap[0].branch


def test_qa_empty_draft_gives_no_examples() -> None:
    assert qa_draft_examples("q1", "Who?", ["Rollo"], True, NORMANS, "") == []
    assert qa_draft_examples("q1", "Who?", ["Rollo"], False, NORMANS, "  \n ") == []


# --- determinism ----------------------------------------------------------------------------------


def build_all(seed: int) -> list[Example]:
    rng = random.Random(seed)
    entities = pool()

    def hard_negative(query: str, own: Passage) -> Passage | None:
        return next(p for p in CORPUS if p.id != own.id)

    out = inverse_cloze(CORPUS, rng, hard_negative)
    out += support_examples(CORPUS, CORPUS, rng, entities)
    out += utility_examples(CORPUS, CORPUS, rng)
    out += retrieve_examples(CORPUS, rng)
    return out


def test_the_same_seed_gives_the_same_examples() -> None:
    first = build_all(0)
    assert first == build_all(0)
    assert len(first) == 2 * 4 + 3 * 4 + 2 * 4 + 2 * 4
    # The seed does steer the choices.
    assert any(build_all(seed) != first for seed in range(1, 6))
