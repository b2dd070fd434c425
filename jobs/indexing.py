"""Index a corpus into a `QdrantStore`: read, split, embed and upsert whole documents, then
take out of the index the documents of that file or folder that are gone from it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from selfrag.infra.corpus.formats import ReadLimits
from selfrag.infra.corpus.passages import Counter
from selfrag.infra.corpus.reading import (
    CorpusError,
    Document,
    read_documents,
)
from selfrag.infra.corpus.safe_files import corpus_root, file_source
from selfrag.infra.corpus.splitting import split_document, split_passages
from selfrag.infra.store.passage_points import embedded_text
from selfrag.infra.store.qdrant_documents import DIGEST, stale
from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.pipeline.protocols import COLLECTION, Passage
from selfrag.schemas.documents import DocumentInfo
from selfrag.schemas.settings import RetrievalSettings

log = logging.getLogger(__name__)
_DEFAULTS = RetrievalSettings()
Splitter = Callable[[Document], list[Passage]]


@dataclass
class IndexReport:
    """What one `index_corpus` call did; `errors` name the file and line of each bad record
    (and each file of a folder that was not read, with why); `removed` counts the documents
    taken out because they are gone from the file or folder."""

    documents: int = 0
    passages: int = 0
    errors: list[CorpusError] = field(default_factory=list)
    seconds: float = 0.0
    removed: int = 0
    removed_passages: int = 0
    unchanged: int = 0
    """Documents read with the digest they were indexed with: not embedded again."""

    @property
    def changed(self) -> bool:
        """Whether the index changed: passages written or documents removed."""
        return bool(self.passages or self.removed)


class PieceCounter:
    """A text's word pieces as the embedder counts them, summed over its words, each word
    counted once (BERT splits at whitespace first, so the sum is the text's count)."""

    def __init__(self, count: Callable[[str], int]) -> None:
        self._count = count
        self._words: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        total = 0
        for word in text.split():
            n = self._words.get(word)
            if n is None:
                n = self._count(word)
                if len(self._words) < 1_000_000:  # bounded: a corpus of unique tokens
                    self._words[word] = n
            total += n
        return total


def _pre_tokens(word: str) -> int:
    """Without an embedder's tokenizer: BERT's pre-tokens (runs of letters and digits, and
    each other character), a lower bound on its word pieces."""
    count, in_word = 0, False
    for c in word:
        if c.isalnum():
            count += not in_word
            in_word = True
        else:
            count += 1
            in_word = False
    return count


def passage_splitter(retrieval: RetrievalSettings, embedder: Any = None) -> Splitter:
    """How documents become passages under `retrieval` (`chunking`), budgeted in `embedder`'s
    word pieces (`count_pieces`, capped at what it reads: `max_seq_length` - 2)."""
    if retrieval.chunking == "words":
        words, overlap = retrieval.passage_words, retrieval.passage_overlap_words
        return lambda doc: split_passages(doc, words, overlap)
    budget = retrieval.passage_tokens
    if (longest := getattr(embedder, "max_seq_length", None)) is not None:
        budget = min(budget, int(longest) - 2)
    count: Counter = PieceCounter(getattr(embedder, "count_pieces", None) or _pre_tokens)
    return lambda doc: split_document(doc, budget, count)


def corpus_passages(
    path: str | Path,
    retrieval: RetrievalSettings = _DEFAULTS,
    embedder: Any = None,
) -> list[Passage]:
    """The passages `index_corpus` would write for `path` (same cuts and ids); unreadable
    records are skipped."""
    split = passage_splitter(retrieval, embedder)
    return [
        tagged(p, Path(path))
        for item in read_documents(
            path, retrieval.max_document_bytes, limits=ReadLimits.of(retrieval)
        )
        if not isinstance(item, CorpusError)
        for p in split(item)
    ]


def document_digest(passages: Sequence[Passage], embedding_model: str) -> str:
    """A digest of a document's passages as they would be indexed: ids, titles, texts and
    metadata (not when or under which collection name), and the model embedding them."""
    h = hashlib.sha256(embedding_model.encode())
    for p in passages:
        meta = {k: v for k, v in p.metadata.items() if k not in (COLLECTION, "indexed_at", DIGEST)}
        h.update(json.dumps([p.id, p.title, p.text, meta], sort_keys=True).encode())
    return h.hexdigest()[:32]


def indexed_documents(store: QdrantStore) -> dict[str, DocumentInfo]:
    """The documents `store` holds, by id (what `CorpusRead.documents` skips when unchanged)."""
    return {d.id: d for d in store.documents()}


def tagged(passage: Passage, path: Path, indexed_at: str | None = None) -> Passage:
    """`passage` with its collection: the name of the corpus file or folder it was indexed
    from (the support threshold is calibrated per collection, whose styles differ), and when
    it was indexed."""
    passage.metadata[COLLECTION] = path.name
    if indexed_at is not None:
        passage.metadata["indexed_at"] = indexed_at
    return passage


class CorpusRead:
    """One read of a corpus file or folder for indexing, whichever way it is embedded
    (`index_corpus` here, `jobs.ray_indexing` on Ray): its documents cut by `retrieval`'s
    splitter in `embedder`'s word pieces and tagged with the path and one `indexed_at`; each
    bad record logged (WARNING) and kept in `report.errors`. Raises FileNotFoundError /
    CorpusFormatError for a missing path or an unknown format when made, before any write."""

    def __init__(
        self,
        path: str | Path,
        retrieval: RetrievalSettings,
        embedder: Any,
        report: IndexReport,
        *,
        follow_links: bool = False,
    ) -> None:
        self.path = Path(path)
        self._items = read_documents(
            path,
            retrieval.max_document_bytes,
            follow_links=follow_links,
            limits=ReadLimits.of(retrieval),
        )
        self._split = passage_splitter(retrieval, embedder)
        self._model = str(getattr(embedder, "model_id", None) or retrieval.embedding_model)
        self._report = report
        self.indexed_at = datetime.now(UTC).isoformat(timespec="seconds")
        self.seen: set[str] = set()
        """The ids of the documents read so far."""

    def documents(
        self, indexed: Mapping[str, DocumentInfo] | None = None
    ) -> Iterator[list[Passage]]:
        """Each readable document's passages, in the corpus's order; those of a document
        `indexed` holds with the same digest and passage count are skipped (counted in the
        report's `unchanged`), so a run after an interrupted one goes on where it stopped."""
        indexed = indexed or {}
        for item in self._items:
            if isinstance(item, CorpusError):
                log.warning("skipped %s", item)
                self._report.errors.append(item)
                continue
            self.seen.add(item.id)
            passages = self._split(item)
            digest = document_digest(passages, self._model)
            known = indexed.get(item.id)
            if known is not None and (known.digest, known.passages) == (digest, len(passages)):
                self._report.unchanged += 1
                continue
            for p in passages:
                p.metadata[DIGEST] = digest
            yield [tagged(p, self.path, self.indexed_at) for p in passages]

    def remove_gone(self, store: QdrantStore, indexed: Mapping[str, DocumentInfo]) -> bool:
        """Once every document was read: remove those `indexed` (the store's documents, listed
        before the read) from the path that this read did not find, except those of files that
        failed to read now; counted in the report. True when any was removed (the caller bumps
        the index version)."""
        failed = {file_source(Path(error.path)) for error in self._report.errors}
        gone = stale(list(indexed.values()), corpus_root(self.path), self.seen, failed)
        if gone:
            self._report.removed = len(gone)
            self._report.removed_passages = store.remove_documents(gone, bump_version=False)
        return bool(gone)


def index_corpus(
    path: str | Path,
    store: QdrantStore,
    embedder_batch: int = 64,
    progress: bool = True,
    *,
    retrieval: RetrievalSettings = _DEFAULTS,
    follow_links: bool = False,
    threads: int | None = None,
) -> IndexReport:
    """Index every readable document of `path` into `store` and report what happened.

    Bad records (unreadable, not UTF-8, over `retrieval.max_document_bytes`, a file of a
    folder that is not read) are logged (one WARNING each, the only report of them besides the
    report's `errors`) and skipped; the rest is indexed.
    Passages go to the store in groups of about `embedder_batch`, each group holding whole
    documents, so an interrupted run never leaves a document half-written, and a document
    indexed already with the same passages and embedding model is not embedded again (so a
    rerun goes on where an interrupted one stopped). A changed document's passages overwrite
    its old ones (stable ids) and the passages it no longer has are dropped; once the whole
    path was read, the documents indexed from it before that it no longer holds are removed
    (not those of a file that failed to read this time).
    `index_version` is bumped at the end when anything was written, even after an error.
    The documents are read ahead of the embedder (`read_ahead`), which runs on `threads`
    llama.cpp threads (default: every core, as indexing is the command's only work;
    `SelfRAG.index` passes `model.n_threads`).
    Raises FileNotFoundError / CorpusFormatError for a missing path or an unknown format.
    """
    if embedder_batch < 1:
        raise ValueError(f"embedder_batch must be >= 1, got {embedder_batch}")
    started = time.perf_counter()
    report = IndexReport()
    corpus = CorpusRead(path, retrieval, store.embedder, report, follow_links=follow_links)
    bar = tqdm(
        desc=f"indexing {Path(path).name}",
        unit="doc",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    changed = False
    try:
        indexed = indexed_documents(store)  # listed once: what to skip, then what is gone
        threads = threads or os.cpu_count() or 1
        _write_in_groups(corpus.documents(indexed), store, embedder_batch, report, bar, threads)
        changed = corpus.remove_gone(store, indexed)
    finally:
        bar.close()
        if report.passages or changed:
            store.bump_index_version()
        report.seconds = time.perf_counter() - started
    return report


@dataclass
class _Group:
    """Whole documents' passages, embedded and written together."""

    passages: list[Passage]
    documents: int
    tokens: list[list[int]] | None
    """The passages' word-piece ids, for an embedder that takes them (`embed_tokens`)."""


def _groups(documents: Iterable[list[Passage]], size: int, embedder: Any) -> Iterator[_Group]:
    """`documents` in groups of whole documents of `size` passages or more (the last one
    less), tokenized for `embedder` when it embeds token ids."""
    tokenize = getattr(embedder, "tokenize", None)
    if not callable(getattr(embedder, "embed_tokens", None)):
        tokenize = None

    def group(passages: list[Passage], count: int) -> _Group:
        tokens = [tokenize(embedded_text(p)) for p in passages] if tokenize else None
        return _Group(passages, count, tokens)

    pending: list[Passage] = []
    count = 0
    for passages in documents:
        pending.extend(passages)
        count += 1
        if len(pending) >= size:
            yield group(pending, count)
            pending, count = [], 0
    if pending:
        yield group(pending, count)


_T = TypeVar("_T")


def read_ahead(items: Iterator[_T], depth: int) -> Iterator[_T]:
    """`items`, made in a thread of their own up to `depth` ahead of the consumer, so reading
    and splitting a corpus overlaps embedding it (llama.cpp releases the GIL). What the maker
    raises is raised here; closing this generator stops the maker at its next item."""
    made: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(kind: str, value: Any) -> bool:
        while not stop.is_set():
            try:
                made.put((kind, value), timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def make() -> None:
        try:
            for item in items:
                if not put("item", item):
                    return
        except BaseException as exc:  # raised again in the consumer
            put("error", exc)
        else:
            put("done", None)

    maker = threading.Thread(target=make, name="selfrag-index-reader", daemon=True)
    maker.start()
    try:
        while True:
            kind, value = made.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        maker.join()


def _write_in_groups(
    documents: Iterable[list[Passage]],
    store: QdrantStore,
    embedder_batch: int,
    report: IndexReport,
    bar: tqdm,
    threads: int,
) -> None:
    """Embed and write the passages of `documents` in groups of whole documents of about
    `embedder_batch` passages, on `threads` embedding threads, counting each group in `report`
    and `bar` once written. The next group is read, split and tokenized while one embeds."""
    embedder = store.embedder
    try:
        for group in read_ahead(_groups(documents, embedder_batch, embedder), depth=2):
            if group.tokens is not None:
                vectors = embedder.embed_tokens(group.tokens, threads=threads)
            else:
                vectors = embedder.embed([embedded_text(p) for p in group.passages])
            store.write(group.passages, vectors, replace_documents=True)
            report.documents += group.documents
            report.passages += len(group.passages)
            bar.update(group.documents)
            bar.set_postfix(passages=report.passages, errors=len(report.errors))
    finally:
        if report.passages:
            store.finish_writes()
