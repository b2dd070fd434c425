"""`selfrag ask`'s text rendering: citations, the score table and the low-support warning."""

from __future__ import annotations

from selfrag.cli.ask import render_answer
from selfrag.schemas.answer import (
    AnswerResponse,
    Citation,
    Evidence,
    PassageOut,
    SegmentOut,
    Usage,
)
from selfrag.schemas.decoding import DecodingConfig


def _response(is_sup: str | None, s_sup: float | None) -> AnswerResponse:
    seg = SegmentOut(
        text="Rollo founded Normandy.",
        citation=Citation(passage_id="p1", title="Normans"),
        retrieved=True,
        p_ret=0.9,
        s_rel=0.8,
        s_sup=s_sup,
        s_use=0.2,
        is_sup=is_sup,
        flags=["low_support"] if is_sup not in (None, "full") else [],
        logprob=-3.0,
        n_tokens=5,
        score=1.0,
    )
    return AnswerResponse(
        question="Who founded Normandy?",
        answer=seg.text,
        abstained=False,
        segments=[seg],
        passages=[PassageOut(id="p1", title="Normans", text="Rollo ...", score=0.5)],
        usage=Usage(),
        timings_ms={"total": 10.0},
        model_id="m",
        critique="learned",
        config=DecodingConfig(),
    )


def test_a_weakly_supported_cited_segment_is_flagged() -> None:
    text = render_answer(_response("none", 0.12))
    assert "Rollo founded Normandy. [1]" in text
    assert "Low support" in text and "segment(s) 1" in text
    row = next(line for line in text.splitlines() if line.startswith(" 1 "))
    assert row.split()[5] == "none"  # the IsSup column of segment 1


def test_uncited_segments_and_terms_missing_from_the_source_are_flagged() -> None:
    r = _response("full", 0.93)
    invented = r.segments[0].model_copy(
        update={
            "text": " He died in 932.",
            "citation": None,
            "flags": ["uncited", "unsupported_terms"],
            "unsupported_terms": ["932"],
        }
    )
    r.segments.append(invented)
    text = render_answer(r)
    assert "Low support" not in text
    assert "Uncited: segment(s) 2 cite no source" in text
    assert "Not in the source: segment 2 states 932" in text


def test_a_fully_supported_segment_is_not_flagged() -> None:
    text = render_answer(_response("full", 0.93))
    assert "Low support" not in text
    assert "full" in text


def test_each_citation_shows_the_sentence_that_supports_its_segment() -> None:
    passage = "Normandy is in France. The Norse leader Rollo founded Normandy in 911."
    r = _response("full", 0.93)
    r.passages[0].text = passage
    start = passage.index("The Norse")
    r.segments[0].citation = Citation(
        passage_id="p1",
        title="Normans",
        evidence=Evidence(start=start, end=len(passage), text=passage[start:]),
    )
    r.segments.append(r.segments[0].model_copy(update={"text": " It was in 911."}))
    lines = render_answer(r).splitlines()
    source = lines.index("[1] Normans (p1)")
    assert lines[source + 1 : source + 3] == [
        "    1: “The Norse leader Rollo founded Normandy in 911.”",
        "    2: “The Norse leader Rollo founded Normandy in 911.”",
    ]
    # Without an evidence span only the source line shows.
    lines = render_answer(_response("full", 0.93)).splitlines()
    assert lines[lines.index("[1] Normans (p1)") + 1] == ""


def test_a_source_names_the_corpus_file_its_passage_was_indexed_from() -> None:
    r = _response("full", 0.93)
    r.passages[0].corpus = "squad_v2_small.json"
    assert "[1] Normans (p1, squad_v2_small.json)" in render_answer(r).splitlines()


HOSTILE = "\x1b]0;PWNED TITLE\x07\x1b[2J\x1b]8;;https://evil.example/\x1b\\link\x1b]8;;\x1b\\\r\x9b2J\u202e"


def test_terminal_control_characters_from_a_corpus_or_model_never_reach_the_terminal(
    monkeypatch, capsys
) -> None:
    """Titles, passages and answers pass through `selfrag ask`'s output and its log lines; what
    the terminal would obey (ESC and BEL sequences, C1 controls, carriage returns, bidi
    overrides) is dropped, what it shows stays."""
    import logging

    import selfrag.cli as cli

    hostile = _response("partial", 0.2)
    seg = hostile.segments[0].model_copy(update={"text": f"Rollo{HOSTILE} founded it."})
    hostile = hostile.model_copy(
        update={
            "segments": [seg],
            "passages": [PassageOut(id="p1", title=f"Normans{HOSTILE}", text="x", score=0.5)],
        }
    )

    def ask(args) -> int:
        logging.getLogger("selfrag.cli").warning("skipped %s", f"file{HOSTILE}.txt")
        print(render_answer(hostile))
        return 0

    monkeypatch.setitem(cli.COMMANDS, "ask", ask)
    assert cli.main(["ask", "q"]) == 0
    out, err = capsys.readouterr()
    for text in (out, err):
        assert not any(c in text for c in "\x1b\x07\x9b\r\u202e"), repr(text)
    assert "Normans]0;PWNED TITLE[2J" in out
    assert "Low support" in out
    assert "skipped file]0;PWNED TITLE" in err


def test_the_support_that_decided_abstention_and_its_threshold_are_shown() -> None:
    r = _response("none", 0.3).model_copy(
        update={"abstained": True, "support": 0.157, "support_threshold": 0.20814}
    )
    assert render_answer(r).splitlines()[-1].endswith(" support=0.157 threshold=0.208")
    off = r.model_copy(update={"support_threshold": 0.0})
    assert render_answer(off).splitlines()[-1].endswith(" support=0.157")
    unread = r.model_copy(update={"support": None})
    assert "support=" not in render_answer(unread)
