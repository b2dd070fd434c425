"""`selfrag index --ray`: documents read and split here, their passages embedded on Ray Data
(one embedder per actor, spread over the cluster's nodes), written to the store here.

The store stays in this process: the embedded one (one machine) or a Qdrant server (a real
cluster). Only texts go to the actors and only vectors come back; every vector is put back at
its passage's place, so the result is the same as `jobs.indexing.index_corpus` gives, written
in whole documents.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from selfrag.infra.embeddings.bert_gguf import BertFormat
from selfrag.infra.embeddings.embedder import resolved_format
from selfrag.infra.store.passage_points import (
    doc_id,
    document_batches,
    document_chunks,
    embedded_text,
)
from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.jobs.indexing import CorpusRead, IndexReport, indexed_documents
from selfrag.schemas.settings import RetrievalSettings

WRITE_BATCH = 256
# Passages embedded per Ray Data run: what an interrupted run can lose, against each run's
# start (its actors load the embedder).
CHUNK_PASSAGES = 4096


class PassageEmbedder:
    """A Ray Data actor: one embedding model, loaded once, embedding batches of texts."""

    def __init__(self, model: str | None, fmt: BertFormat, threads: int) -> None:
        from selfrag.infra.embeddings.embedder import SentenceEmbedder

        self._embedder = SentenceEmbedder(model, threads=threads, fmt=fmt)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        vectors = self._embedder.embed([str(t) for t in batch["text"]])
        return {"i": batch["i"], "vector": vectors}


def embed_on_ray(
    texts: Sequence[str],
    model: str | None,
    dim: int,
    *,
    fmt: BertFormat,
    actors: int,
    batch_size: int = 64,
    progress: bool = True,
) -> np.ndarray:
    """The vectors of `texts`, in their order, embedded by `actors` Ray Data actors of one CPU
    each (one llama.cpp thread), all in the weight format `fmt`, whatever their node's CPU."""
    import ray.data

    if not texts:
        return np.zeros((0, dim), dtype=np.float32)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = progress
    rows = [{"i": i, "text": t} for i, t in enumerate(texts)]
    blocks = max(1, min(len(rows) // batch_size, actors * 8))
    ds = ray.data.from_items(rows, override_num_blocks=blocks).map_batches(
        PassageEmbedder,
        fn_constructor_kwargs={"model": model, "fmt": fmt, "threads": 1},
        batch_size=batch_size,
        batch_format="numpy",
        concurrency=actors,
        num_cpus=1,
    )
    out = np.zeros((len(texts), dim), dtype=np.float32)
    seen = 0
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        out[batch["i"]] = np.stack(batch["vector"])
        seen += len(batch["i"])
    if seen != len(texts):
        raise RuntimeError(f"Ray Data returned {seen} vectors for {len(texts)} passages")
    return out


def index_corpus_ray(
    path: str | Path,
    store: QdrantStore,
    *,
    retrieval: RetrievalSettings,
    actors: int = 2,
    address: str | None = None,
    follow_links: bool = False,
    progress: bool = True,
    chunk_passages: int = CHUNK_PASSAGES,
) -> IndexReport:
    """`index_corpus` with the embedding on Ray (a private local instance, or the cluster at
    `address`): the same passages, vectors, removals and report. Documents are embedded and
    written `chunk_passages` at a time (whole documents), and those indexed already with the
    same digest are skipped, so a run after an interrupted one goes on where it stopped."""
    from selfrag.jobs.ray_pool import ensure_ray
    from selfrag.runtime.ray_cluster import shutdown_private_ray

    if actors < 1:
        raise ValueError(f"actors must be >= 1, got {actors}")
    started = time.perf_counter()
    report = IndexReport()
    corpus = CorpusRead(path, retrieval, store.embedder, report, follow_links=follow_links)
    indexed = indexed_documents(store)  # listed once: what to skip, then what is gone
    # Resolved here: every actor writes the vectors of the format this index records.
    fmt = resolved_format(retrieval.embedding_format)
    documents = corpus.documents(indexed)
    connected = started_ray = changed = False
    try:
        for chunk in document_chunks(documents, chunk_passages):
            if not connected:  # Ray only when there is something to embed
                started_ray, connected = ensure_ray(address), True
            vectors = embed_on_ray(
                [embedded_text(p) for p in chunk],
                retrieval.embedding_model,
                store.embedder.dim,
                fmt=fmt,
                actors=actors,
                progress=progress,
            )
            done = 0
            for batch in document_batches(chunk, WRITE_BATCH):
                store.write(batch, vectors[done : done + len(batch)], replace_documents=True)
                done += len(batch)
            store.finish_writes()
            report.documents += len({doc_id(p) for p in chunk})
            report.passages += len(chunk)
        changed = corpus.remove_gone(store, indexed)
    finally:
        if started_ray:
            shutdown_private_ray()
        if report.passages or changed:
            store.bump_index_version()
        report.seconds = time.perf_counter() - started
    return report
