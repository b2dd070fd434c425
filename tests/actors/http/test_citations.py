"""A document's URL from the corpus to the citation (infra/corpus/reading.py, the Qdrant payload),
and
the citations in client shapes (actors/http/citations.py): annotation spans and passage URLs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfrag.actors.http.citations import AnswerText, annotations, cited_urls, passage_url
from selfrag.infra.corpus.reading import CorpusError, Document, read_documents
from selfrag.infra.corpus.splitting import split_passages
from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.jobs.indexing import index_corpus
from selfrag.schemas.answer import AnswerResponse, Citation, SegmentOut, Usage
from selfrag.schemas.decoding import DecodingConfig
from tests.fakes import HashEmbedder

URL = "https://en.wikipedia.org/wiki/Rollo"


def _jsonl(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def test_a_jsonl_url_is_read_and_a_bad_one_is_an_error_by_line(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path,
        [
            {"id": "a", "text": "Rollo founded Normandy.", "url": URL},
            {"id": "b", "text": "No address.", "url": ""},
            {"id": "c", "text": "x", "url": "javascript:alert(1)"},
            {"id": "d", "text": "x", "url": "/wiki/Rollo"},
            {"id": "e", "text": "x", "url": 7},
            {"id": "f", "text": "x", "url": "https://a.b/" + "x" * 3000},
            {"id": "g", "text": "x", "url": "https://a.b/with space"},
            {"id": "h", "text": "x", "url": "http://[::1"},
            {"id": "i", "text": "no url field"},
        ],
    )
    items = list(read_documents(path))
    docs = {d.id: d.url for d in items if isinstance(d, Document)}
    assert docs == {"a": URL, "b": None, "i": None}
    errors = {e.line: e.reason for e in items if isinstance(e, CorpusError)}
    assert sorted(errors) == [3, 4, 5, 6, 7, 8]
    assert "absolute http(s) URL" in errors[3] and "'javascript:alert(1)'" in errors[3]
    assert errors[5] == "'url' is not a string" and "longer than 2048" in errors[6]


def test_every_passage_of_a_document_carries_its_url() -> None:
    doc = Document(id="rollo", title="Rollo", text=" ".join(["word"] * 25), url=URL)
    passages = split_passages(doc, words=10, overlap=2)
    assert len(passages) == 3
    assert all(
        p.metadata == {"doc_id": "rollo", "url": URL, "doc_title": "Rollo"} for p in passages
    )
    plain = split_passages(Document(id="x", title=None, text="a b"), 10, 2)
    assert plain[0].metadata == {"doc_id": "x"}


def test_the_store_gives_the_url_back_with_the_passage(tmp_path: Path) -> None:
    from selfrag.schemas.settings import RetrievalSettings

    path = _jsonl(
        tmp_path,
        [
            {"id": "rollo", "title": "Rollo", "text": "Rollo founded Normandy.", "url": URL},
            {"id": "apples", "title": "Apples", "text": "Normandy grows apples."},
        ],
    )
    with QdrantStore.open(RetrievalSettings(), tmp_path / "home", HashEmbedder()) as store:
        index_corpus(path, store, progress=False)
        found = {p.id: p.metadata for p in store.search("Rollo founded Normandy", 2)}
    # The corpus file, for per-collection calibration, and the source `selfrag docs` lists.
    kept = {"collection": path.name, "source": str(path.resolve())}
    for meta in found.values():
        assert meta.pop("indexed_at") >= "2026"
        assert len(meta.pop("doc_digest")) == 32  # re-indexing skips an unchanged document
    assert found == {
        "rollo": {"doc_id": "rollo", "url": URL, "doc_title": "Rollo", **kept},
        "apples": {"doc_id": "apples", "doc_title": "Apples", **kept},
    }


def _segment(text: str, citation: Citation | None) -> SegmentOut:
    return SegmentOut(
        text=text, citation=citation, retrieved=True, logprob=-1.0, n_tokens=3, score=0.5
    )


def _response(segments: list[SegmentOut], abstained: bool = False) -> AnswerResponse:
    return AnswerResponse(
        question="q",
        answer="".join(s.text for s in segments).strip(),
        abstained=abstained,
        segments=segments,
        passages=[],
        usage=Usage(),
        timings_ms={},
        model_id="m",
        critique="learned",
        config=DecodingConfig(),
    )


def test_a_passage_without_a_url_gets_a_stable_selfrag_url() -> None:
    assert passage_url(Citation(passage_id="p1", url=URL)) == URL
    assert passage_url(Citation(passage_id="c.jsonl@ab12:3#0")) == (
        "selfrag://passage/c.jsonl%40ab12%3A3%230"
    )
    assert passage_url(Citation(passage_id="squad:Normans/x y")) == (
        "selfrag://passage/squad%3ANormans%2Fx%20y"
    )


def test_annotations_span_each_cited_segment_of_the_answer_text() -> None:
    rollo = Citation(passage_id="p1", title="Rollo", url=URL)
    segments = [
        _segment("  \n", None),  # blank: dropped from the front of the text
        _segment(" Rollo founded Normandy. ", rollo),
        _segment("It was in 911.", None),
        _segment(" The treaty was signed  ", Citation(passage_id="p 2")),
        _segment(" there.", rollo),
    ]
    r = _response(segments)
    notes = annotations(r)
    spans = [r.answer[a.url_citation.start_index : a.url_citation.end_index] for a in notes]
    assert spans == ["Rollo founded Normandy.", "The treaty was signed", "there."]
    assert [(a.type, a.url_citation.url, a.url_citation.title) for a in notes] == [
        ("url_citation", URL, "Rollo"),
        ("url_citation", "selfrag://passage/p%202", "p 2"),  # no title: the id
        ("url_citation", URL, "Rollo"),
    ]
    assert cited_urls(r) == [URL, "selfrag://passage/p%202"]
    # A stream's text is the same segments appended: the same spans, in the text sent so far.
    text, streamed = AnswerText(), ""
    for segment, note in zip(segments, [None, *notes[:1], None, *notes[1:]], strict=True):
        part, placed = text.append(segment)
        streamed += part
        assert placed == note
    assert streamed.rstrip() == r.answer
    # An abstention's text is the abstention message: nothing in it to annotate.
    assert annotations(_response(segments, abstained=True)) == []
    assert cited_urls(_response(segments, abstained=True)) == []


def test_an_answer_joined_differently_gets_no_wrong_span() -> None:
    r = _response([_segment(" Rollo founded Normandy.", Citation(passage_id="p1"))])
    r.answer = "Rollo, who founded Normandy."
    assert annotations(r) == []


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://user:pass@docs.example/a?b=c#d", "https://docs.example/a?b=c#d"),
        ("https://bank.example@evil.example/login", "https://evil.example/login"),
        ("HTTPS://token@Docs.Example:8443/x", "https://docs.example:8443/x"),
        # Cyrillic "а" and "о": shown as the punycode name they are.
        ("https://p\u0430yp\u0430l.example/", "https://xn--pypl-53dc.example/"),
        ("https://g\u043e\u043egle.example/a", "https://xn--ggle-55da.example/a"),
        ("https://[::1]:8080/p", "https://[::1]:8080/p"),
        ("https://en.wikipedia.org/wiki/Rollo", "https://en.wikipedia.org/wiki/Rollo"),
    ],
)
def test_a_cited_url_goes_out_without_credentials_and_with_a_look_alike_host_spelt_out(
    url: str, shown: str
) -> None:
    r = _response([_segment("Rollo founded Normandy.", Citation(passage_id="p1", url=url))])
    assert passage_url(Citation(passage_id="p1", url=url)) == shown
    assert [a.url_citation.url for a in annotations(r)] == [shown]
    assert cited_urls(r) == [shown]


@pytest.mark.parametrize("url", ["javascript:alert(1)", "https://", "https://a b.example/"])
def test_a_cited_url_that_is_no_http_link_falls_back_to_the_passages(url: str) -> None:
    assert passage_url(Citation(passage_id="p1", url=url)) == "selfrag://passage/p1"


def test_annotation_titles_go_out_as_plain_text() -> None:
    title = '<img src=x onerror="alert(1)">Normans\x1b]0;PWNED\x07 \u202e<b>history</b> 1 < 2'
    r = _response([_segment("Rollo founded Normandy.", Citation(passage_id="p1", title=title))])
    [note] = annotations(r)
    assert note.url_citation.title == "Normans]0;PWNED history 1 &lt; 2"
    bare = _response([_segment("Rollo.", Citation(passage_id="p1", title="<i></i>\x07"))])
    assert annotations(bare)[0].url_citation.title == "p1"
