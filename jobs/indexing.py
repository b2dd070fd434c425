"""Index a corpus into a `QdrantStore`: read, split, embed and upsert whole documents."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from selfrag.infra.corpus import MAX_DOCUMENT_BYTES, CorpusError, read_documents, split_passages
from selfrag.infra.qdrant_store import QdrantStore
from selfrag.pipeline.protocols import COLLECTION, Passage
from selfrag.schemas.settings import RetrievalSettings

log = logging.getLogger(__name__)
# Window defaults follow the deployment settings' defaults.
_DEFAULTS = RetrievalSettings()


@dataclass
class IndexReport:
    """What one `index_corpus` call did; `errors` name the file and line of each bad record."""

    documents: int = 0
    passages: int = 0
    errors: list[CorpusError] = field(default_factory=list)
    seconds: float = 0.0


def corpus_passages(
    path: str | Path,
    passage_words: int = _DEFAULTS.passage_words,
    overlap: int = _DEFAULTS.passage_overlap_words,
    max_document_bytes: int = MAX_DOCUMENT_BYTES,
) -> list[Passage]:
    """The passages `index_corpus` would write for `path` (same cuts and ids); unreadable
    records are skipped."""
    return [
        tagged(p, Path(path))
        for item in read_documents(path, max_document_bytes)
        if not isinstance(item, CorpusError)
        for p in split_passages(item, passage_words, overlap)
    ]


def tagged(passage: Passage, path: Path) -> Passage:
    """`passage` with its collection: the name of the corpus file or folder it was indexed
    from (the support threshold is calibrated per collection, whose styles differ)."""
    passage.metadata[COLLECTION] = path.name
    return passage


def index_corpus(
    path: str | Path,
    store: QdrantStore,
    embedder_batch: int = 64,
    progress: bool = True,
    *,
    passage_words: int = _DEFAULTS.passage_words,
    overlap: int = _DEFAULTS.passage_overlap_words,
    max_document_bytes: int = MAX_DOCUMENT_BYTES,
) -> IndexReport:
    """Index every readable document of `path` into `store` and report what happened.

    Bad records (unreadable, not UTF-8, over `max_document_bytes`) are logged (one WARNING
    each, the only report of them besides the report's `errors`) and skipped; the rest is
    indexed.
    Passages go to the store in groups of about `embedder_batch`, each group holding whole
    documents, so an interrupted run never leaves a document half-written. Re-indexing the
    same corpus overwrites its passages (stable ids) and drops passages a document no longer
    has. `index_version` is bumped at the end when anything was written, even after an error.
    Raises FileNotFoundError / CorpusFormatError for a missing path or an unknown format.
    """
    if embedder_batch < 1:
        raise ValueError(f"embedder_batch must be >= 1, got {embedder_batch}")
    started = time.perf_counter()
    report = IndexReport()
    items = read_documents(
        path, max_document_bytes
    )  # raises here, before any write, for a bad path
    pending: list[Passage] = []
    pending_docs = 0
    bar = tqdm(
        desc=f"indexing {Path(path).name}",
        unit="doc",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )

    def flush() -> None:
        nonlocal pending, pending_docs
        if pending:
            store.upsert(
                pending, batch_size=len(pending), replace_documents=True, bump_version=False
            )
            report.documents += pending_docs
            report.passages += len(pending)
            bar.update(pending_docs)
            bar.set_postfix(passages=report.passages, errors=len(report.errors))
        pending, pending_docs = [], 0

    try:
        for item in items:
            if isinstance(item, CorpusError):
                log.warning("skipped %s", item)
                report.errors.append(item)
                continue
            pending.extend(
                tagged(p, Path(path)) for p in split_passages(item, passage_words, overlap)
            )
            pending_docs += 1
            if len(pending) >= embedder_batch:
                flush()
        flush()
    finally:
        bar.close()
        if report.passages:
            store.bump_index_version()
        report.seconds = time.perf_counter() - started
    return report
