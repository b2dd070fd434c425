"""Indexing's pipeline: documents read ahead of the embedder in a thread of their own, grouped
across documents, embedded from their word-piece ids on the threads asked for."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.jobs.indexing import index_corpus, read_ahead
from selfrag.schemas.settings import RetrievalSettings
from tests.fakes import HashEmbedder


class TokenEmbedder(HashEmbedder):
    """`HashEmbedder` that also embeds word-piece ids (one id per word here), recording each
    call's texts and threads and the thread it was tokenized in."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None]] = []
        self.embedded: list[str] = []
        self.tokenized_in: set[str] = set()
        self._words: dict[int, str] = {}

    def tokenize(self, text: str) -> list[int]:
        self.tokenized_in.add(threading.current_thread().name)
        ids = []
        for word in text.split():
            self._words.setdefault(hash(word), word)
            ids.append(hash(word))
        return ids

    def embed_tokens(
        self, sequences: Sequence[list[int]], *, threads: int | None = None
    ) -> np.ndarray:
        self.calls.append((len(sequences), threads))
        texts = [" ".join(self._words[i] for i in ids) for ids in sequences]
        self.embedded += texts
        return self.embed(texts)


def _corpus(path: Path, documents: int) -> Path:
    lines = [
        json.dumps({"id": str(i), "title": f"Doc {i}", "text": f"Document {i} tells of item {i}."})
        for i in range(documents)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_ahead_keeps_the_order_and_runs_its_maker_in_another_thread() -> None:
    makers: set[str] = set()

    def items() -> Iterator[int]:
        for i in range(10):
            makers.add(threading.current_thread().name)
            yield i

    assert list(read_ahead(items(), depth=2)) == list(range(10))
    assert makers == {"selfrag-index-reader"}


def test_read_ahead_raises_what_its_maker_raised_after_what_it_made() -> None:
    def items() -> Iterator[int]:
        yield 1
        raise ValueError("line 2 is not JSON")

    got = []
    with pytest.raises(ValueError, match="line 2"):
        for item in read_ahead(items(), depth=2):
            got.append(item)
    assert got == [1]


def test_closing_read_ahead_stops_its_maker() -> None:
    made: list[int] = []

    def items() -> Iterator[int]:
        for i in range(1000):
            made.append(i)
            yield i

    ahead = read_ahead(items(), depth=2)
    assert next(ahead) == 0
    time.sleep(0.3)  # the maker fills the queue, then waits
    ahead.close()  # joins the maker
    assert len(made) <= 4  # one taken, two queued, one waiting to be put
    assert not [t for t in threading.enumerate() if t.name == "selfrag-index-reader"]


def test_indexing_groups_documents_and_embeds_their_ids_on_the_threads_asked(
    tmp_path: Path,
) -> None:
    corpus = _corpus(tmp_path / "docs.jsonl", 10)
    tokens, texts = TokenEmbedder(), HashEmbedder()
    settings = RetrievalSettings()
    with (
        QdrantStore.open(settings, tmp_path / "a", tokens) as by_ids,
        QdrantStore.open(settings, tmp_path / "b", texts) as by_texts,
    ):
        report = index_corpus(corpus, by_ids, embedder_batch=4, progress=False, threads=3)
        index_corpus(corpus, by_texts, embedder_batch=4, progress=False)
        assert (report.documents, report.passages) == (10, 10)
        # Across documents, 4 passages a call (the last one less), each on 3 threads.
        assert tokens.calls == [(4, 3), (4, 3), (2, 3)]
        assert tokens.tokenized_in == {"selfrag-index-reader"}  # read ahead, tokens too
        # The ids embedded are those of the texts the other index embedded.
        assert sorted(tokens.embedded) == sorted(p.text for p in by_texts.passages())
        assert by_ids.count() == by_texts.count() == 10


def test_a_bad_record_is_reported_and_the_rest_indexed_through_the_read_ahead(
    tmp_path: Path,
) -> None:
    corpus = _corpus(tmp_path / "docs.jsonl", 3)
    corpus.write_text(corpus.read_text() + "{not json\n", encoding="utf-8")
    with QdrantStore.open(RetrievalSettings(), tmp_path / "home", TokenEmbedder()) as store:
        report = index_corpus(corpus, store, progress=False)
    assert (report.documents, len(report.errors)) == (3, 1)
