"""Evidence spans (pipeline/evidence.py): the passage sentence that best supports a segment,
its offsets into the passage, and the drafted citation that carries it (with the URL)."""

from __future__ import annotations

import re

import pytest

from selfrag.pipeline.critics import Branch
from selfrag.pipeline.evidence import evidence_span
from selfrag.pipeline.learning.reflection_data import sentences
from selfrag.pipeline.protocols import Generation, Passage
from selfrag.pipeline.ranking import Candidate
from selfrag.pipeline.segmenting import sentence_spans

NORMANDY = (
    "Normandy is a region in the north of France. The Norse leader Rollo founded Normandy "
    "in 911, after a treaty with Charles the Simple. Normandy is known for its apples and "
    "its cheese."
)


def _check(passage: str, segment: str) -> str:
    span = evidence_span(passage, segment)
    assert span is not None
    assert passage[span.start : span.end] == span.text
    return span.text


def test_the_sentence_whose_words_the_segment_copies_is_chosen() -> None:
    assert _check(NORMANDY, " Rollo founded it in 911.") == (
        "The Norse leader Rollo founded Normandy in 911, after a treaty with Charles the Simple."
    )
    assert _check(NORMANDY, "It is famous for apples.") == (
        "Normandy is known for its apples and its cheese."
    )


def test_a_word_in_every_sentence_decides_nothing() -> None:
    # "Normandy" is in all three sentences; "north" only in the first.
    assert _check(NORMANDY, "Normandy lies in the north.") == (
        "Normandy is a region in the north of France."
    )


def test_ties_go_to_the_earlier_sentence_and_no_shared_word_is_no_span() -> None:
    passage = "Rollo was a Viking. Rollo was a count."
    assert _check(passage, "Rollo.") == "Rollo was a Viking."
    assert evidence_span(NORMANDY, "Paris hosts the Louvre.") is None
    assert evidence_span(NORMANDY, "It was in the.") is None  # stopwords only
    assert evidence_span("", "Rollo") is None


def test_offsets_count_characters_not_bytes() -> None:
    passage = "Caf\u00e9 \U0001f600 culture is old. Rollo liked cr\u00eape in 911."
    span = evidence_span(passage, "Rollo ate cr\u00eape.")
    assert span is not None
    assert (span.start, span.text) == (passage.index("Rollo"), "Rollo liked cr\u00eape in 911.")
    assert passage[span.start : span.end] == span.text


# The split reflection_data used before sentence_spans existed: training data must not change.
_OLD_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


@pytest.mark.parametrize(
    "text",
    [
        NORMANDY,
        '  Leading space. Then (a bracket) here! And 3 more? "Quoted" end.  ',
        "No end mark at all",
        "",
        "One.  Two.\n\nThree dots... 4 wins.",
    ],
)
def test_sentence_spans_split_as_training_data_always_did(text: str) -> None:
    old = [s.strip() for s in _OLD_SPLIT.split(text) if s.strip()]
    assert [text[a:b] for a, b in sentence_spans(text)] == old
    assert sentences(text) == [s for s in old if len(s.split()) >= 6]


def test_a_drafted_citation_carries_its_evidence_and_the_documents_url() -> None:
    passage = Passage(
        id="normandy#0",
        text=NORMANDY,
        title="Normandy",
        metadata={"doc_id": "normandy", "url": "https://en.wikipedia.org/wiki/Normandy"},
    )
    candidate = Candidate(
        parent=0,
        branch=Branch("Who founded Normandy?", "", passage),
        retrieved=True,
        p_ret=0.9,
        draft=Generation(
            tokens=[1, 2, 3],
            text=" Rollo founded it in 911.",
            logprobs=[-0.5, -0.25, -0.25],
            finish_reason="sentence",
            prefill_tokens=10,
        ),
    )
    citation = candidate.drafted().citation
    assert citation is not None
    assert citation.url == "https://en.wikipedia.org/wiki/Normandy"
    assert citation.evidence is not None and citation.evidence.text.startswith("The Norse")
    no_passage = Candidate(0, Branch("q", "", None), True, 0.9, draft=candidate.draft)
    assert no_passage.drafted().citation is None
