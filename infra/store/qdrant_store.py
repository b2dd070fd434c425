"""Passage store and retriever on Qdrant: Qdrant Edge in this process by default
(infra.store.qdrant_edge), or a Qdrant server (`retrieval.qdrant_url`, infra.store.qdrant_server)
through qdrant-client. One class, `QdrantStore`, over the two engines
(infra.store.qdrant_engine), so both write and score alike; an index's facts are checked
against the embedder by infra.store.qdrant_facts; passages become points and back in
infra.store.passage_points.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from selfrag.infra.lifecycle import Closeable
from selfrag.infra.store import sparse
from selfrag.infra.store.passage_points import (
    doc_id,
    document_batches,
    embedded_text,
    passage_of,
    point_data,
)
from selfrag.infra.store.qdrant_documents import documents_of, matching
from selfrag.infra.store.qdrant_edge import EdgeEngine
from selfrag.infra.store.qdrant_engine import (
    Embedder,
    Engine,
    IndexMissing,
    Search,
    StoreError,
    StoreHeld,
    StoreMisconfigured,
    StoreUnavailable,
    cosine,
    point_id,
    search_order,
)
from selfrag.infra.store.qdrant_facts import NO_VERSION, adopt, check_facts, new_facts, replaced_by
from selfrag.infra.store.qdrant_server import ServerEngine
from selfrag.pipeline.protocols import Passage
from selfrag.schemas.documents import DocumentInfo, Removal
from selfrag.schemas.settings import RetrievalSettings

# The store's public API; the errors and `point_id` are defined in infra.store.qdrant_engine.
__all__ = [
    "IndexMissing",
    "QdrantStore",
    "StoreError",
    "StoreHeld",
    "StoreMisconfigured",
    "StoreUnavailable",
    "point_id",
]


class QdrantStore(Closeable):
    """A `PassageSearch` over one Qdrant collection, plus the writes indexing needs."""

    def __init__(self, engine: Engine, settings: RetrievalSettings, embedder: Embedder) -> None:
        self._engine = engine
        self._settings = settings
        self._embedder = embedder
        self._collection = settings.collection
        # Both engines are thread-safe, but a check-then-create must not interleave.
        self._lock = threading.RLock()
        self._exists = False
        self._closed = False

    @classmethod
    def open(cls, settings: RetrievalSettings, home: Path, embedder: Embedder) -> QdrantStore:
        """Connect to `settings.qdrant_url`, or open the embedded store in `home/edge`.

        The collection itself is created on the first `upsert` (`require_index` says whether
        there is one to search). Raises StoreError when the embedded store is already open (in
        this or another process), StoreMisconfigured when an existing index was built by a
        different embedding model, BM25 scheme or format, or holds vectors of another size
        than the embedder's, and StoreUnavailable when the server does not answer.
        """
        engine: Engine
        if settings.qdrant_url:
            engine = ServerEngine(settings)
        else:
            engine = EdgeEngine.open(Path(home), settings.collection, embedder)
        store = cls(engine, settings, embedder)
        try:
            with store._lock:
                store._collection_exists()  # checks an existing index against the embedder
        except StoreError:
            store.close()
            raise
        except Exception as error:
            store.close()
            raise StoreUnavailable(f"Qdrant at {store.where} does not answer: {error}") from error
        return store

    @property
    def where(self) -> str:
        """The server URL or the embedded folder, for messages."""
        return self._engine.where

    @property
    def kind(self) -> str:
        """`embedded` (Qdrant Edge in this process) or `server`."""
        return self._engine.kind

    def require_index(self) -> None:
        """Raise IndexMissing unless the collection exists (searching then finds nothing)."""
        with self._lock:
            exists = self._collection_exists()
        if not exists:
            raise IndexMissing(
                f"the collection {self._collection!r} does not exist in {self.where}: "
                "run `selfrag index PATH` with these settings first"
            )

    @property
    def collection(self) -> str:
        return self._collection

    @property
    def embedder(self) -> Embedder:
        return self._embedder

    @property
    def hybrid(self) -> bool:
        return self._settings.hybrid

    def close(self) -> None:
        """Release the engine (and the embedded store's lock); safe to call twice."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._engine.close()

    def ready(self) -> bool:
        """True when the store answers a request."""
        if self._closed:
            return False
        try:
            self._engine.ping()
        except Exception:
            return False
        return True

    def count(self) -> int:
        """Number of passages stored (0 when the collection does not exist yet)."""
        with self._lock:
            if not self._collection_exists():
                return 0
        return self._engine.count()

    def index_version(self) -> str:
        """An opaque value that changes whenever indexing changes the collection's content.

        `"empty"` while the collection does not exist. Query caches key on it. Costs one
        request to a server, so callers that check it per query may want to cache it briefly.
        """
        with self._lock:
            if not self._collection_exists():
                return NO_VERSION
            return str(self._engine.facts().get("index_version", NO_VERSION))

    def bump_index_version(self) -> str:
        """Record that the content changed; returns the new version."""
        version = uuid.uuid4().hex
        with self._lock:
            self._ensure_collection()
            self._engine.update_facts({"index_version": version})
        return version

    def upsert(
        self,
        passages: Sequence[Passage],
        batch_size: int = 64,
        *,
        replace_documents: bool = False,
        bump_version: bool = True,
    ) -> int:
        """Embed and write `passages`; returns how many were written.

        Requests hold whole documents (consecutive passages with the same `doc_id`), so a
        document is never half-written; one request may exceed `batch_size` for a long document.
        With `replace_documents`, every other passage of the same documents is deleted after
        the write (a re-indexed document that got shorter leaves nothing stale); only use it
        when `passages` holds each of its documents complete.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not passages:
            return 0
        written = 0
        for batch in document_batches(passages, batch_size):
            vectors = self._embedder.embed([embedded_text(p) for p in batch])
            written += self.write(batch, vectors, replace_documents=replace_documents)
        self.finish_writes()
        if bump_version:
            self.bump_index_version()
        return written

    def write(
        self,
        passages: Sequence[Passage],
        vectors: Sequence[Sequence[float]] | Any,
        *,
        replace_documents: bool = False,
    ) -> int:
        """Write `passages` with their dense `vectors`, embedded already (by this store's
        embedder model: `embedded_text` of each, elsewhere, as `selfrag index --ray` does);
        `replace_documents` as in `upsert`. Call `finish_writes` after the last one."""
        if len(passages) != len(vectors):
            raise ValueError(f"{len(passages)} passages but {len(vectors)} vectors")
        with self._lock:
            self._ensure_collection()
        rows = zip(passages, vectors, strict=True)
        points = [point_data(p, [float(x) for x in v]) for p, v in rows]
        with self._lock:
            self._engine.upsert(points)
            if replace_documents:
                doc_ids = sorted({doc_id(p) for p in passages})
                self._engine.delete_stale(doc_ids, [p.id for p in points])
        return len(points)

    def finish_writes(self) -> None:
        """Let the engine build its indexes after writes (embedded: HNSW once large enough)."""
        with self._lock:
            if self._collection_exists():
                self._engine.finish_writes()

    def search(self, query: str, k: int) -> list[Passage]:
        """The `k` best passages for `query`, best first; [] when nothing is indexed.

        Dense cosine search, or with `settings.hybrid` dense and BM25 results fused
        (`settings.fusion`).
        `Passage.score` is Qdrant's score (cosine similarity, or the fused score when hybrid);
        `Passage.similarity` is the cosine similarity either way.
        """
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        """`search` for each query, embedded together and sent as one batch."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not queries:
            return []
        with self._lock:
            if not self._collection_exists():
                return [[] for _ in queries]
        dense = self._embedder.embed(list(queries))
        searches = [
            Search.of(
                vector.tolist(),
                sparse.query_vector(q) if self._settings.hybrid else None,
                k,
                self._settings.fusion,
            )
            for q, vector in zip(queries, dense, strict=True)
        ]
        results = self._engine.search(searches)
        found = [
            [passage_of(h.payload, h.score, cosine(vector, h.dense)) for h in hits]
            for vector, hits in zip(dense, results, strict=True)
        ]
        return [
            sorted(passages, key=lambda p: search_order(p.score, p.similarity or 0.0, p.id))[:k]
            for passages in found
        ]

    def similarities(self, pairs: Sequence[tuple[str, Passage]]) -> list[float]:
        """The embedder's cosine of each (query, passage) pair, the passage as indexed: the
        `Passage.similarity` a search for the query would give it, found or not. Each distinct
        text is embedded once, all in one call."""
        texts = list(dict.fromkeys(t for q, p in pairs for t in (q, embedded_text(p))))
        if not texts:
            return []
        vector = dict(zip(texts, self._embedder.embed(texts), strict=True))
        return [cosine(vector[q], vector[embedded_text(p)]) for q, p in pairs]

    def passages(self, batch: int = 256) -> Iterator[Passage]:
        """Every indexed passage, in the collection's point order (for `selfrag train`)."""
        for payload in self._payloads(batch):
            yield passage_of(payload, 0.0)

    def documents(self) -> list[DocumentInfo]:
        """The indexed documents: id, source, title, passages, when indexed."""
        return documents_of(self._payloads())

    def match_documents(self, refs: Sequence[str]) -> tuple[list[str], list[str]]:
        """The ids of the documents named by `refs` (ids, or paths of files or folders they
        were indexed from), and the refs that name none."""
        return matching(self.documents(), refs)

    def remove(self, refs: Sequence[str]) -> Removal:
        """Remove the documents `refs` name (ids, or files or folders they were indexed from)
        and say what went, and which refs named nothing."""
        ids, unmatched = self.match_documents(refs)
        passages = self.remove_documents(ids)
        return Removal(documents=ids, passages=passages, unmatched=unmatched)

    def remove_documents(self, doc_ids: Collection[str], *, bump_version: bool = True) -> int:
        """Delete every passage of `doc_ids` (dense and BM25 vectors with it); returns how many
        there were. The index version changes (with `bump_version`), so no cached answer of
        before is served again."""
        if not doc_ids:
            return 0
        with self._lock:
            if not self._collection_exists():
                return 0
        wanted = set(doc_ids)
        before = sum(1 for p in self._payloads() if str(p.get("doc_id", "")) in wanted)
        ids = sorted(wanted)
        with self._lock:
            for start in range(0, len(ids), 1000):
                self._engine.delete_documents(ids[start : start + 1000])
            self._engine.finish_writes()
        if bump_version:
            self.bump_index_version()
        return before

    # -- internals --------------------------------------------------------------------------

    def _payloads(self, batch: int = 1024) -> Iterator[dict[str, Any]]:
        with self._lock:
            if not self._collection_exists():
                return
        offset: Any = None
        while True:
            payloads, offset = self._engine.scroll(batch, offset)
            yield from payloads
            if offset is None:
                break

    def _collection_exists(self) -> bool:
        """Whether the collection exists; the caller holds the lock. A collection found for
        the first time is checked against the embedder (StoreMisconfigured if it does not
        match, which is not cached: the check runs again on the next call)."""
        # Cache a positive answer: collections are not dropped under a running store, and
        # asking a server on every search would cost a round trip.
        if not self._exists and self._engine.exists():
            facts = self._engine.facts()
            if facts.get("embedding_model") in replaced_by(self._embedder):
                facts = adopt(self._engine, self._collection, self._embedder, facts)
            check_facts(facts, self._collection, self._embedder)
            self._exists = True
        return self._exists

    def _ensure_collection(self) -> None:
        """Create the collection with both vectors; the caller holds the lock."""
        if self._collection_exists():
            return
        self._engine.create(self._embedder.dim, new_facts(self._embedder))
        # Another process may have created it meanwhile: then it must match this embedder too.
        check_facts(self._engine.facts(), self._collection, self._embedder)
        self._exists = True
