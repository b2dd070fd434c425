"""How passages become points (infra/store/passage_points.py): the document a passage belongs
to, and the one grouping of passages into batches of whole documents that the store's writes
and the Ray indexer share."""

from __future__ import annotations

from selfrag.infra.store.passage_points import doc_id, document_batches, document_chunks
from selfrag.pipeline.protocols import Passage


def _doc(name: str, n: int) -> list[Passage]:
    return [
        Passage(id=f"{name}#{i}", text=f"{name} {i}", metadata={"doc_id": name}) for i in range(n)
    ]


def _ids(chunks: list[list[Passage]]) -> list[list[str]]:
    return [[p.id for p in chunk] for chunk in chunks]


def test_a_passage_without_a_document_is_its_own():
    assert doc_id(Passage(id="p1", text="x")) == "p1"
    assert doc_id(_doc("a", 1)[0]) == "a"


def test_chunks_hold_whole_documents_of_at_least_the_size_but_the_last():
    docs = [_doc("a", 2), _doc("b", 3), _doc("c", 1), _doc("d", 1)]
    chunks = list(document_chunks(docs, 4))
    assert _ids(chunks) == [["a#0", "a#1", "b#0", "b#1", "b#2"], ["c#0", "d#0"]]
    assert list(document_chunks([], 4)) == []


def test_flat_passages_are_cut_only_between_documents():
    docs = [_doc("a", 2), _doc("b", 3), _doc("c", 1), _doc("d", 1)]
    flat = [p for d in docs for p in d]
    assert _ids(list(document_batches(flat, 4))) == _ids(list(document_chunks(docs, 4)))
    # A document longer than the size stays whole; size 1 cuts at every document.
    assert _ids(list(document_batches(_doc("long", 5), 2))) == [[f"long#{i}" for i in range(5)]]
    assert [len(b) for b in document_batches(flat, 1)] == [2, 3, 1, 1]
