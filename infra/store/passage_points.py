"""How a passage is written as a Qdrant point (its embedded text, vectors and payload), and
read back from a payload; shared by both store engines and the Ray indexer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import groupby
from typing import Any

from selfrag.infra.store import sparse
from selfrag.infra.store.qdrant_documents import DIGEST
from selfrag.infra.store.qdrant_engine import PointData, point_id
from selfrag.pipeline.protocols import COLLECTION, Passage


def doc_id(passage: Passage) -> str:
    """The document a passage belongs to: its `doc_id` metadata, or its own id."""
    return passage.metadata.get("doc_id", passage.id)


def embedded_text(passage: Passage) -> str:
    """What is embedded (dense and BM25) for `passage`: its text, after its title when it has
    a section path (a heading's words are then searchable; the passage text leaves them out).
    Passages without one keep text only: prefixing the title measured no better on the Normans
    questions (Wikipedia passages open with their title; SQuAD paragraphs share theirs)."""
    if passage.metadata.get("section") and passage.title:
        return f"{passage.title}\n{passage.text}"
    return passage.text


def point_data(passage: Passage, dense: list[float]) -> PointData:
    """The point written for `passage` with dense vector `dense`."""
    return PointData(
        id=point_id(passage.id),
        dense=dense,
        sparse=sparse.document_vector(embedded_text(passage)),
        payload={
            "passage_id": passage.id,
            "title": passage.title,
            "text": passage.text,
            "doc_id": doc_id(passage),
            # Absent when the corpus gave none: citations then use selfrag://passage/<id>.
            **({"url": passage.metadata["url"]} if passage.metadata.get("url") else {}),
            **{key: passage.metadata[key] for key in _KEPT if passage.metadata.get(key)},
            **({"page": int(page)} if (page := passage.metadata.get("page")) else {}),
        },
    )


# Passage metadata kept in the payload as it is (besides `doc_id`, `url` and `page`).
_KEPT = (COLLECTION, "source", "doc_title", "section", "indexed_at", DIGEST)


def document_chunks(documents: Iterable[list[Passage]], size: int) -> Iterator[list[Passage]]:
    """The passages of `documents` (each a document's passages) in chunks of whole documents,
    each `size` passages or more (the last one less)."""
    chunk: list[Passage] = []
    for passages in documents:
        chunk.extend(passages)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def document_batches(passages: Iterable[Passage], size: int) -> Iterator[list[Passage]]:
    """`passages` in batches of at least `size` (but the last), cut only between documents
    (runs of passages of one `doc_id`)."""
    return document_chunks((list(run) for _, run in groupby(passages, key=doc_id)), size)


def passage_of(payload: dict[str, Any], score: float, similarity: float | None = None) -> Passage:
    """The passage a point's payload holds, with its search `score` and `similarity`."""
    doc = str(payload.get("doc_id", ""))
    url = payload.get("url")
    page = payload.get("page")
    return Passage(
        id=str(payload.get("passage_id", "")),
        text=str(payload.get("text", "")),
        title=payload.get("title"),
        score=float(score or 0.0),
        metadata=({"doc_id": doc} if doc else {})
        | ({"url": url} if isinstance(url, str) else {})
        | {key: payload[key] for key in _KEPT if isinstance(payload.get(key), str)}
        | ({"page": str(page)} if isinstance(page, int) and not isinstance(page, bool) else {}),
        similarity=similarity,
    )
