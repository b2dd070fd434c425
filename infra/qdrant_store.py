"""Passage store and retriever on Qdrant: embedded on disk by default, or a Qdrant server.

Collection layout (one collection, `RetrievalSettings.collection`):
- named dense vector `dense` (cosine, the embedder's width) and named sparse vector `sparse`
  (BM25 term weights from `infra.sparse`, IDF applied by Qdrant). Both are always written, so
  `hybrid` can be switched on later without re-indexing.
- point id = uuid5 of the passage id, so re-indexing the same passage overwrites it.
- payload `{passage_id, title, text, doc_id}`.
- collection metadata `{index_version, embedding_model, sparse_scheme}`. Collection metadata
  lives with the collection both in embedded mode and on a server (Qdrant >= 1.16), so every
  process sharing the index sees the same `index_version`.

Embedded mode locks its folder: only one `QdrantStore` (one client) per path per process, and
no other process either. Call `close()` (or use the store as a context manager) before
opening the same folder again. Use a Qdrant server for several processes.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from qdrant_client import QdrantClient, models

from selfrag.infra import sparse
from selfrag.infra.lifecycle import Closeable
from selfrag.pipeline.protocols import Passage
from selfrag.schemas.settings import RetrievalSettings

DENSE = "dense"
SPARSE = "sparse"
# Fixed namespace: the same passage id maps to the same point id on every machine.
_POINT_NAMESPACE = uuid.UUID("6f1c3a52-2d4e-5b8a-9c0e-51f0a7b3d9e4")
# Each branch of a hybrid query fetches this many times `k` before fusion, so a passage ranked
# a little lower by one method can still be lifted by the other.
_HYBRID_PREFETCH_FACTOR = 4
_HYBRID_PREFETCH_MIN = 20
_NO_VERSION = "empty"
# Embedded folders this process has open (resolved paths), to refuse a second client early.
_OPEN_FOLDERS: set[str] = set()
_OPEN_FOLDERS_LOCK = threading.Lock()


class Embedder(Protocol):
    """What the store needs from an embedder (`infra.embedder.SentenceEmbedder` fits)."""

    @property
    def dim(self) -> int: ...

    @property
    def model_id(self) -> str: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


class StoreError(RuntimeError):
    """The store cannot be opened or does not match the embedder."""


class StoreUnavailable(StoreError):
    """The Qdrant server does not answer (down, unreachable): may work on a later try."""


class StoreMisconfigured(StoreError):
    """The index cannot serve this configuration (built by another embedder, with vectors of
    another size, or not built at all): no retry helps until someone re-indexes or fixes the
    settings."""


class IndexMissing(StoreMisconfigured):
    """The collection does not exist: nothing was indexed yet (or into another collection)."""


def point_id(passage_id: str) -> str:
    """The stable Qdrant point id of a passage."""
    return str(uuid.uuid5(_POINT_NAMESPACE, passage_id))


class QdrantStore(Closeable):
    """A `Retriever` over one Qdrant collection, plus the writes indexing needs."""

    def __init__(
        self,
        client: QdrantClient,
        settings: RetrievalSettings,
        embedder: Embedder,
        *,
        local: bool,
        folder: Path | None = None,
    ) -> None:
        self._client = client
        self._settings = settings
        self._embedder = embedder
        self._collection = settings.collection
        self._local = local
        # Embedded Qdrant is plain Python state without locking of its own: serialise every
        # call. A server client is thread-safe, so it gets no lock.
        self._lock: AbstractContextManager[Any] = threading.RLock() if local else nullcontext()
        self._exists = False
        self._closed = False
        self._folder = folder

    @classmethod
    def open(cls, settings: RetrievalSettings, home: Path, embedder: Embedder) -> QdrantStore:
        """Connect to `settings.qdrant_url`, or open (creating) the embedded store `home/qdrant`.

        The collection itself is created on the first `upsert` (`require_index` says whether
        there is one to search). Raises StoreError when the embedded folder is already open (in
        this or another process), StoreMisconfigured when an existing collection was built by a
        different embedding model or holds vectors of another size than the embedder's, and
        StoreUnavailable when the server does not answer.
        """
        if settings.qdrant_url:
            key = settings.qdrant_api_key.get_secret_value() if settings.qdrant_api_key else None
            client = QdrantClient(url=settings.qdrant_url, api_key=key)
            store = cls(client, settings, embedder, local=False)
        else:
            folder = (Path(home) / "qdrant").resolve()
            folder.mkdir(parents=True, exist_ok=True)
            # Checked here first: qdrant-client's own lock check (which also covers other
            # processes) leaks the lock file's handle when it refuses.
            with _OPEN_FOLDERS_LOCK:
                if str(folder) in _OPEN_FOLDERS:
                    raise StoreError(_already_open(folder))
                try:
                    # Our own lock serialises calls, so the SQLite same-thread check can go.
                    client = QdrantClient(path=str(folder), force_disable_check_same_thread=True)
                except RuntimeError as error:
                    if "already accessed" not in str(error):
                        raise
                    raise StoreError(_already_open(folder)) from error
                _OPEN_FOLDERS.add(str(folder))
            store = cls(client, settings, embedder, local=True, folder=folder)
        try:
            with store._lock:
                store._collection_exists()  # checks an existing collection against the embedder
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
        return self._settings.qdrant_url or str(self._folder)

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
        """Release the client (and the embedded folder's lock); safe to call twice."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._client.close()
                if self._folder is not None:
                    with _OPEN_FOLDERS_LOCK:
                        _OPEN_FOLDERS.discard(str(self._folder))

    def ready(self) -> bool:
        """True when the store answers a request."""
        if self._closed:
            return False
        try:
            with self._lock:
                self._client.get_collections()
        except Exception:
            return False
        return True

    def count(self) -> int:
        """Number of passages stored (0 when the collection does not exist yet)."""
        with self._lock:
            if not self._collection_exists():
                return 0
            return self._client.count(self._collection, exact=True).count

    def index_version(self) -> str:
        """An opaque value that changes whenever indexing changes the collection's content.

        `"empty"` while the collection does not exist. Query caches key on it. Costs one
        request to a server, so callers that check it per query may want to cache it briefly.
        """
        with self._lock:
            if not self._collection_exists():
                return _NO_VERSION
            metadata = self._client.get_collection(self._collection).config.metadata or {}
        return str(metadata.get("index_version", _NO_VERSION))

    def bump_index_version(self) -> str:
        """Record that the content changed; returns the new version."""
        version = uuid.uuid4().hex
        with self._lock:
            self._ensure_collection()
            self._client.update_collection(self._collection, metadata={"index_version": version})
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
        with self._lock:
            self._ensure_collection()
        written = 0
        for batch in _document_batches(passages, batch_size):
            # Text only: prefixing the title measured no better on the Normans questions (the
            # Wikipedia passages already open with their title; SQuAD paragraphs share theirs).
            vectors = self._embedder.embed([p.text for p in batch])
            points = [_point(p, vector) for p, vector in zip(batch, vectors, strict=True)]
            with self._lock:
                self._client.upsert(self._collection, points=points, wait=True)
                if replace_documents:
                    self._delete_stale(batch, [str(point.id) for point in points])
            written += len(points)
        if bump_version:
            self.bump_index_version()
        return written

    def search_many(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        return [self.search(q, k) for q in queries]

    def search(self, query: str, k: int) -> list[Passage]:
        """The `k` best passages for `query`, best first; [] when nothing is indexed.

        Dense cosine search, or with `settings.hybrid` dense and BM25 results fused by RRF.
        `Passage.score` is Qdrant's score (cosine similarity, or the RRF score when hybrid).
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        with self._lock:
            if not self._collection_exists():
                return []
        dense = self._embedder.embed([query])[0].tolist()
        terms = sparse.query_vector(query) if self._settings.hybrid else None
        if terms:
            depth = max(k * _HYBRID_PREFETCH_FACTOR, _HYBRID_PREFETCH_MIN)
            request: dict[str, Any] = {
                "prefetch": [
                    models.Prefetch(query=dense, using=DENSE, limit=depth),
                    models.Prefetch(
                        query=models.SparseVector(indices=terms.indices, values=terms.values),
                        using=SPARSE,
                        limit=depth,
                    ),
                ],
                "query": models.FusionQuery(fusion=models.Fusion.RRF),
            }
        else:
            # Not hybrid, or a query of stop words only: the sparse branch would find nothing.
            request = {"query": dense, "using": DENSE}
        with self._lock:
            response = self._client.query_points(
                self._collection, limit=k, with_payload=True, with_vectors=False, **request
            )
        return [_passage(point) for point in response.points]

    def passages(self, batch: int = 256) -> Iterator[Passage]:
        """Every indexed passage, in the collection's point order (for `selfrag train`)."""
        with self._lock:
            if not self._collection_exists():
                return
        offset: Any = None
        while True:
            with self._lock:
                points, offset = self._client.scroll(
                    self._collection,
                    limit=batch,
                    offset=offset,
                    with_payload=True,
                    with_vectors=False,
                )
            for point in points:
                yield _passage(point)
            if offset is None:
                break

    # -- internals --------------------------------------------------------------------------

    def _collection_exists(self) -> bool:
        """Whether the collection exists; the caller holds the lock. A collection found for
        the first time is checked against the embedder (StoreMisconfigured if it does not
        match, which is not cached: the check runs again on the next call)."""
        # Cache a positive answer: collections are not dropped under a running store, and
        # asking a server on every search would cost a round trip.
        if not self._exists and self._client.collection_exists(self._collection):
            self._check_compatible()
            self._exists = True
        return self._exists

    def _check_compatible(self) -> None:
        """Refuse a collection built by another embedding model or sparse scheme, or with
        dense vectors of another size than the embedder's; the caller holds the lock."""
        config = self._client.get_collection(self._collection).config
        name = self._collection
        metadata = config.metadata or {}
        built_with = metadata.get("embedding_model")
        if built_with is not None and built_with != self._embedder.model_id:
            raise StoreMisconfigured(
                f"collection {name!r} was indexed with {built_with}, but the "
                f"embedder is {self._embedder.model_id}: re-index into another collection"
            )
        scheme = metadata.get("sparse_scheme")
        if scheme is not None and scheme != sparse.SCHEME:
            raise StoreMisconfigured(
                f"collection {name!r} holds sparse vectors of scheme {scheme}, "
                f"this code writes {sparse.SCHEME}: re-index into another collection"
            )
        vectors = config.params.vectors
        dense = vectors.get(DENSE) if isinstance(vectors, dict) else None
        if dense is None:
            raise StoreMisconfigured(
                f"collection {name!r} has no {DENSE!r} vector: it was not built by "
                "`selfrag index`; re-index into another collection"
            )
        if dense.size != self._embedder.dim:
            raise StoreMisconfigured(
                f"collection {name!r} holds vectors of size {dense.size}, but the embedder "
                f"{self._embedder.model_id} gives {self._embedder.dim}: re-index with this "
                "embedder (into another collection), or configure the one it was built with"
            )

    def _ensure_collection(self) -> None:
        """Create the collection with both vectors; the caller holds the lock."""
        if self._collection_exists():
            return
        try:
            self._client.create_collection(
                self._collection,
                vectors_config={
                    DENSE: models.VectorParams(
                        size=self._embedder.dim, distance=models.Distance.COSINE
                    )
                },
                sparse_vectors_config={
                    SPARSE: models.SparseVectorParams(modifier=models.Modifier.IDF)
                },
                metadata={
                    "index_version": _NO_VERSION,
                    "embedding_model": self._embedder.model_id,
                    "sparse_scheme": sparse.SCHEME,
                },
            )
        except Exception:
            # Another process may have created it in the meantime (then it must match too);
            # anything else re-raises.
            if not self._client.collection_exists(self._collection):
                raise
            self._check_compatible()
        if not self._local:
            # Servers need a payload index for the doc_id filter of `replace_documents`;
            # the embedded store scans and would only warn.
            self._client.create_payload_index(
                self._collection, "doc_id", field_schema=models.PayloadSchemaType.KEYWORD
            )
        self._exists = True

    def _delete_stale(self, batch: Sequence[Passage], keep: list[str]) -> None:
        doc_ids = sorted({_doc_id(p) for p in batch})
        self._client.delete(
            self._collection,
            points_selector=models.FilterSelector(
                filter=models.Filter(
                    must=[models.FieldCondition(key="doc_id", match=models.MatchAny(any=doc_ids))],
                    must_not=[models.HasIdCondition(has_id=keep)],
                )
            ),
            wait=True,
        )


def _already_open(folder: Path) -> str:
    return (
        f"the embedded Qdrant store {folder} is already open (one client per folder and "
        "process): close() the other store first, or use a Qdrant server"
    )


def _doc_id(passage: Passage) -> str:
    return passage.metadata.get("doc_id", passage.id)


def _document_batches(passages: Sequence[Passage], size: int) -> Iterator[list[Passage]]:
    batch: list[Passage] = []
    for i, passage in enumerate(passages):
        batch.append(passage)
        next_doc = _doc_id(passages[i + 1]) if i + 1 < len(passages) else None
        # Cut only between documents, once the batch is full.
        if len(batch) >= size and next_doc != _doc_id(passage):
            yield batch
            batch = []
    if batch:
        yield batch


def _point(passage: Passage, vector: np.ndarray) -> models.PointStruct:
    terms = sparse.document_vector(passage.text)
    return models.PointStruct(
        id=point_id(passage.id),
        vector={
            DENSE: vector.tolist(),
            SPARSE: models.SparseVector(indices=terms.indices, values=terms.values),
        },
        payload={
            "passage_id": passage.id,
            "title": passage.title,
            "text": passage.text,
            "doc_id": _doc_id(passage),
        },
    )


def _passage(point: models.ScoredPoint | models.Record) -> Passage:
    payload = point.payload or {}
    doc_id = str(payload.get("doc_id", ""))
    return Passage(
        id=str(payload.get("passage_id", point.id)),
        text=str(payload.get("text", "")),
        title=payload.get("title"),
        score=float(getattr(point, "score", 0.0) or 0.0),
        metadata={"doc_id": doc_id} if doc_id else {},
    )
