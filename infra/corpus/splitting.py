"""Splitting a read `Document` into passages: windows of words, or by its structure
(infra.corpus.passages), each passage carrying its document's metadata."""

from __future__ import annotations

from selfrag.infra.corpus.passages import Counter, structured_passages
from selfrag.infra.corpus.reading import Document
from selfrag.pipeline.protocols import Passage


def split_passages(doc: Document, words: int, overlap: int) -> list[Passage]:
    """Split `doc` into windows of at most `words` words, consecutive windows sharing `overlap`.

    Ids are `{doc.id}` for a one-passage document and `{doc.id}#{n}` (n from 0) otherwise, so
    re-indexing the same document overwrites its passages. Whitespace is normalised to single
    spaces. Windows start every `words - overlap` words; the last one may be shorter.
    """
    if words < 1:
        raise ValueError(f"words must be >= 1, got {words}")
    if not 0 <= overlap < words:
        raise ValueError(f"overlap must be in [0, words), got {overlap} with words={words}")
    tokens = doc.text.split()
    metadata = _metadata(doc)
    if len(tokens) <= words:
        return [Passage(id=doc.id, text=" ".join(tokens), title=doc.title, metadata=metadata)]
    step = words - overlap
    passages: list[Passage] = []
    start = 0
    while True:
        end = min(start + words, len(tokens))
        passages.append(
            Passage(
                id=f"{doc.id}#{len(passages)}",
                text=" ".join(tokens[start:end]),
                title=doc.title,
                metadata=dict(metadata),
            )
        )
        if end == len(tokens):
            return passages
        start += step


def split_document(doc: Document, budget: int, count: Counter) -> list[Passage]:
    """Split `doc` by its structure (infra.corpus.passages): passages of at most `budget` word
    pieces as
    `count` counts them, within one section and page; the section path in the title.
    Ids as `split_passages` gives them."""
    return structured_passages(doc.id, doc.title, doc.structure(), budget, count, _metadata(doc))


def _metadata(doc: Document) -> dict[str, str]:
    """The metadata every passage of `doc` carries."""
    return (
        {"doc_id": doc.id}
        | ({"url": doc.url} if doc.url else {})
        | ({"source": doc.source} if doc.source else {})
        | ({"doc_title": doc.title} if doc.title else {})
    )
