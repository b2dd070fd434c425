"""Passage store and retriever on Qdrant: Qdrant Edge in this process by default, or a Qdrant
server (`retrieval.qdrant_url`) through qdrant-client. One class, `QdrantStore`, over the two
engines, so both write and score alike.

Layout (one collection, `RetrievalSettings.collection`):
- named dense vector `dense` (cosine, the embedder's width) and named sparse vector `sparse`
  (Qdrant's BM25, `infra.sparse`, IDF applied by the engine). Both are always written, so
  `hybrid` can be switched on later without re-indexing.
- point id = uuid5 of the passage id, so re-indexing the same passage overwrites it.
- payload `{passage_id, title, text, doc_id, url?}` (`url` when the corpus gave one), with a
  keyword index on `doc_id`.
- the index's facts `{format, index_version, embedding_model, sparse_scheme, dense_size}`: on a
  server in the collection's metadata (every process sharing it sees the same version); on the
  embedded store in `index.json` beside the shard, replaced atomically.

The embedded store (`home/edge/<collection>/`) belongs to one process: the one that holds the
folder's `.lock` (flock, with the shard open), so a second open, here or in another process, is
refused (StoreError). Use a Qdrant server for several processes. A folder with no index yet is
not held: the first write takes the lock (waiting while another process that created the index
meanwhile still holds it, then writing into that index), and a process that opened it empty
takes over an index built later by another one, once that one has closed it (looked for at
most once a second). `index.json` is written last, so a shard without it, left by a crash, is
removed and created again. An embedded index of the earlier format (qdrant-client's local mode
in `home/qdrant/`) is migrated on first open into a shard of its own, switched to only once
complete: dense vectors and payloads are copied, the BM25 vectors recomputed; nothing is
embedded again. A migration that fails or is killed leaves no index, and the next open starts
it again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import qdrant_edge as edge

from selfrag.infra import sparse
from selfrag.infra.file_lock import FileLock, fsync_dir, write_atomic
from selfrag.infra.lifecycle import Closeable
from selfrag.pipeline.protocols import Passage
from selfrag.schemas.settings import RetrievalSettings

if TYPE_CHECKING:
    from qdrant_client import QdrantClient

log = logging.getLogger("selfrag.store")

DENSE = "dense"
SPARSE = "sparse"
INDEX_FORMAT = 2
"""1: qdrant-client local mode with selfrag's own BM25; 2: Qdrant Edge with Qdrant's BM25."""
FACTS_FILE = "index.json"
_SHARD = "shard"
_NEW_SHARD = "shard.new"  # a migration's copy, until it is complete
_LOCK_FILE = ".lock"
# A process that opened a folder with no index looks for one built since at most this often.
_LOOK_AGAIN_S = 1.0
# How long an open waits for a process that holds the folder's lock while it has no index yet
# (looking for one, or creating or migrating it).
_OPEN_WAIT_S = 10.0
FIRST_INDEX_WAIT_S = 600.0
"""How long a first write waits for another process that created the index meanwhile (a
`selfrag index` running alongside) to close it."""
# Fixed namespace: the same passage id maps to the same point id on every machine.
_POINT_NAMESPACE = uuid.UUID("6f1c3a52-2d4e-5b8a-9c0e-51f0a7b3d9e4")
# Each branch of a hybrid query fetches this many times `k` before fusion, so a passage ranked
# a little lower by one method can still be lifted by the other.
_HYBRID_PREFETCH_FACTOR = 4
_HYBRID_PREFETCH_MIN = 20
_RRF_K = 60  # Qdrant's default RRF constant
_NO_VERSION = "empty"
# An index recorded as built by an embedder the current one replaces (`Embedder.replaces`) is
# reused when this many of its passages re-embed to vectors this close to the stored ones.
ADOPT_SAMPLE = 32
ADOPT_MIN_COSINE = 0.999
# Embedded folders this process has open (resolved paths), to refuse a second store early.
_OPEN_FOLDERS: set[str] = set()
_OPEN_FOLDERS_LOCK = threading.Lock()


class Embedder(Protocol):
    """What the store needs from an embedding model."""

    @property
    def dim(self) -> int: ...

    @property
    def model_id(self) -> str: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def replaced_by(embedder: Embedder) -> frozenset[str]:
    """The ids of embedders whose indexes `embedder` may reuse after a sample check (its
    optional `replaces` attribute; none for an embedder without one)."""
    return frozenset(getattr(embedder, "replaces", ()))


class StoreError(RuntimeError):
    """The store cannot be opened or used."""


class StoreUnavailable(StoreError):
    """The Qdrant server does not answer (it may come back)."""


class StoreMisconfigured(StoreError):
    """The index cannot serve with these settings: someone has to act (re-index, configure)."""


class IndexMissing(StoreMisconfigured):
    """No index was built with these settings."""


def point_id(passage_id: str) -> str:
    """The Qdrant point id of a passage: a stable UUID derived from its id."""
    return str(uuid.uuid5(_POINT_NAMESPACE, passage_id))


@dataclass(frozen=True)
class PointData:
    """One passage as written: its point id, both vectors and its payload."""

    id: str
    dense: list[float]
    sparse: sparse.SparseVec
    payload: dict[str, Any]


@dataclass(frozen=True)
class Search:
    """One query: its dense vector and, for hybrid search, its BM25 terms."""

    dense: list[float]
    terms: sparse.SparseVec | None
    limit: int


class Engine(Protocol):
    """What `QdrantStore` needs of a Qdrant engine (Edge in-process, or a server)."""

    kind: str
    where: str

    def exists(self) -> bool: ...

    def facts(self) -> dict[str, Any]: ...

    def create(self, dim: int, facts: dict[str, Any]) -> None: ...

    def update_facts(self, changes: dict[str, Any]) -> None: ...

    def upsert(self, points: Sequence[PointData]) -> None: ...

    def delete_stale(self, doc_ids: Sequence[str], keep: Sequence[str]) -> None: ...

    def finish_writes(self) -> None: ...

    def count(self) -> int: ...

    def search(self, searches: Sequence[Search]) -> list[list[tuple[dict[str, Any], float]]]: ...

    def scroll(self, limit: int, offset: Any) -> tuple[list[dict[str, Any]], Any]: ...

    def sample(self, limit: int) -> list[tuple[dict[str, Any], list[float]]]: ...

    def ping(self) -> None: ...

    def close(self) -> None: ...


class QdrantStore(Closeable):
    """A `Retriever` over one Qdrant collection, plus the writes indexing needs."""

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
                return _NO_VERSION
            return str(self._engine.facts().get("index_version", _NO_VERSION))

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
        with self._lock:
            self._ensure_collection()
        written = 0
        for batch in _document_batches(passages, batch_size):
            # Text only: prefixing the title measured no better on the Normans questions (the
            # Wikipedia passages already open with their title; SQuAD paragraphs share theirs).
            vectors = self._embedder.embed([p.text for p in batch])
            points = [point_data(p, v.tolist()) for p, v in zip(batch, vectors, strict=True)]
            with self._lock:
                self._engine.upsert(points)
                if replace_documents:
                    doc_ids = sorted({doc_id(p) for p in batch})
                    self._engine.delete_stale(doc_ids, [p.id for p in points])
            written += len(points)
        with self._lock:
            self._engine.finish_writes()
        if bump_version:
            self.bump_index_version()
        return written

    def search(self, query: str, k: int) -> list[Passage]:
        """The `k` best passages for `query`, best first; [] when nothing is indexed.

        Dense cosine search, or with `settings.hybrid` dense and BM25 results fused by RRF.
        `Passage.score` is Qdrant's score (cosine similarity, or the RRF score when hybrid).
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
            Search(
                vector.tolist(),
                sparse.query_vector(q) if self._settings.hybrid else None,
                k,
            )
            for q, vector in zip(queries, dense, strict=True)
        ]
        results = self._engine.search(searches)
        return [[_passage(payload, score) for payload, score in hits] for hits in results]

    def passages(self, batch: int = 256) -> Iterator[Passage]:
        """Every indexed passage, in the collection's point order (for `selfrag train`)."""
        with self._lock:
            if not self._collection_exists():
                return
        offset: Any = None
        while True:
            payloads, offset = self._engine.scroll(batch, offset)
            for payload in payloads:
                yield _passage(payload, 0.0)
            if offset is None:
                break

    # -- internals --------------------------------------------------------------------------

    def _collection_exists(self) -> bool:
        """Whether the collection exists; the caller holds the lock. A collection found for
        the first time is checked against the embedder (StoreMisconfigured if it does not
        match, which is not cached: the check runs again on the next call)."""
        # Cache a positive answer: collections are not dropped under a running store, and
        # asking a server on every search would cost a round trip.
        if not self._exists and self._engine.exists():
            facts = self._engine.facts()
            if facts.get("embedding_model") in replaced_by(self._embedder):
                facts = self._adopt(facts)
            check_facts(facts, self._collection, self._embedder)
            self._exists = True
        return self._exists

    def _adopt(self, facts: dict[str, Any]) -> dict[str, Any]:
        """Take over an index built by an embedder this one replaces: re-embed a sample of
        its passages, and when every vector matches the stored one (cosine >= 0.999) record
        this embedder as the index's; StoreMisconfigured naming the fix otherwise."""
        built_with = facts["embedding_model"]
        sample = self._engine.sample(ADOPT_SAMPLE)
        worst = 1.0
        if sample:
            fresh = self._embedder.embed([str(payload.get("text", "")) for payload, _ in sample])
            stored = np.asarray([vector for _, vector in sample], dtype=np.float32)
            norms = np.linalg.norm(fresh, axis=1) * np.linalg.norm(stored, axis=1)
            worst = float(np.min(np.sum(fresh * stored, axis=1) / np.maximum(norms, 1e-12)))
        if worst < ADOPT_MIN_COSINE:
            raise StoreMisconfigured(
                f"collection {self._collection!r} in {self.where} was indexed with {built_with}, "
                f"whose vectors the embedder {self._embedder.model_id} does not reproduce "
                f"(cosine {worst:.4f} < {ADOPT_MIN_COSINE} on a sample of {len(sample)} "
                "passages): re-index, e.g. `selfrag --home NEW_HOME index PATH...` (or set "
                "retrieval.collection to a new name)"
            )
        self._engine.update_facts({"embedding_model": self._embedder.model_id})
        log.warning(
            "collection %r was indexed with %s; %s re-embeds %d of its passages alike "
            "(cosine >= %.6f): reused, and recorded as indexed with %s",
            self._collection,
            built_with,
            self._embedder.model_id,
            len(sample),
            worst,
            self._embedder.model_id,
        )
        return {**facts, "embedding_model": self._embedder.model_id}

    def _ensure_collection(self) -> None:
        """Create the collection with both vectors; the caller holds the lock."""
        if self._collection_exists():
            return
        self._engine.create(self._embedder.dim, new_facts(self._embedder))
        # Another process may have created it meanwhile: then it must match this embedder too.
        check_facts(self._engine.facts(), self._collection, self._embedder)
        self._exists = True


def new_facts(embedder: Embedder) -> dict[str, Any]:
    """The facts of an index this code writes, before its first content."""
    return {
        "format": INDEX_FORMAT,
        "index_version": _NO_VERSION,
        "embedding_model": embedder.model_id,
        "sparse_scheme": sparse.SCHEME,
        "dense_size": embedder.dim,
    }


def check_facts(facts: dict[str, Any], name: str, embedder: Embedder) -> None:
    """Refuse an index built by another embedding model, BM25 scheme or format, or with
    dense vectors of another size than the embedder's."""
    built_with = facts.get("embedding_model")
    if built_with is not None and built_with != embedder.model_id:
        raise StoreMisconfigured(
            f"collection {name!r} was indexed with {built_with}, but the "
            f"embedder is {embedder.model_id}: re-index into another collection"
        )
    scheme = facts.get("sparse_scheme")
    if scheme is not None and scheme != sparse.SCHEME:
        raise StoreMisconfigured(
            f"collection {name!r} holds sparse vectors of scheme {scheme!r}, this code writes "
            f"{sparse.SCHEME!r}: re-index (`selfrag index` into another collection or a fresh "
            "SELFRAG_HOME)"
        )
    size = facts.get("dense_size")
    if size is None:
        raise StoreMisconfigured(
            f"collection {name!r} has no {DENSE!r} vector: it was not built by "
            "`selfrag index`; re-index into another collection"
        )
    if size != embedder.dim:
        raise StoreMisconfigured(
            f"collection {name!r} holds vectors of size {size}, but the embedder "
            f"{embedder.model_id} gives {embedder.dim}: re-index with this "
            "embedder (into another collection), or configure the one it was built with"
        )


def doc_id(passage: Passage) -> str:
    return passage.metadata.get("doc_id", passage.id)


def point_data(passage: Passage, dense: list[float]) -> PointData:
    return PointData(
        id=point_id(passage.id),
        dense=dense,
        sparse=sparse.document_vector(passage.text),
        payload={
            "passage_id": passage.id,
            "title": passage.title,
            "text": passage.text,
            "doc_id": doc_id(passage),
            # Absent when the corpus gave none: citations then use selfrag://passage/<id>.
            **({"url": passage.metadata["url"]} if passage.metadata.get("url") else {}),
        },
    )


def _document_batches(passages: Sequence[Passage], size: int) -> Iterator[list[Passage]]:
    batch: list[Passage] = []
    for i, passage in enumerate(passages):
        batch.append(passage)
        next_doc = doc_id(passages[i + 1]) if i + 1 < len(passages) else None
        # Cut only between documents, once the batch is full.
        if len(batch) >= size and next_doc != doc_id(passage):
            yield batch
            batch = []
    if batch:
        yield batch


def _passage(payload: dict[str, Any], score: float) -> Passage:
    doc = str(payload.get("doc_id", ""))
    url = payload.get("url")
    return Passage(
        id=str(payload.get("passage_id", "")),
        text=str(payload.get("text", "")),
        title=payload.get("title"),
        score=float(score or 0.0),
        metadata=({"doc_id": doc} if doc else {}) | ({"url": url} if isinstance(url, str) else {}),
    )


def _depth(k: int) -> int:
    return max(k * _HYBRID_PREFETCH_FACTOR, _HYBRID_PREFETCH_MIN)


# --- Qdrant Edge, in this process --------------------------------------------------------------


class EdgeEngine:
    """One Qdrant Edge shard in `home/edge/<collection>/shard`, facts in `index.json` beside it.

    `.lock` in the folder (flock) is held by the process that has the shard open, and for a
    moment by one that looks for an index or creates or migrates one. `index.json` is written
    last, so a shard without it (a crash during a create or a migration) is removed and made
    again by whoever takes the lock next.
    """

    kind = "embedded"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.where = str(folder)
        self._lock = FileLock(folder / _LOCK_FILE)
        self._shard: edge.EdgeShard | None = None
        self._closed = False
        self._looked = time.monotonic()

    @classmethod
    def open(cls, home: Path, collection: str, embedder: Embedder) -> EdgeEngine:
        folder = (home / "edge" / collection).resolve()
        with _OPEN_FOLDERS_LOCK:
            if str(folder) in _OPEN_FOLDERS:
                raise StoreError(_already_open(folder))
            _OPEN_FOLDERS.add(str(folder))
        engine = cls(folder)
        try:
            engine._open(home / "qdrant", collection, embedder)
        except BaseException:
            engine.close()
            raise
        return engine

    def _open(self, old: Path, collection: str, embedder: Embedder) -> None:
        # Without index.json, a holder of the lock is only looking, or creating or migrating
        # the index (then this open is refused once it is done): wait for it a little.
        wait = 0.0 if (self.folder / FACTS_FILE).is_file() else _OPEN_WAIT_S
        try:
            locked = self._lock.acquire(timeout_s=wait)
        except OSError as error:
            raise StoreError(
                f"the embedded store {self.folder} cannot be opened: {error}"
            ) from error
        if not locked:
            raise StoreError(_already_open(self.folder))
        try:
            self._shard = self._load_locked()
            if self._shard is None and (old / "collection" / collection).is_dir():
                try:
                    migrate_local_store(old, collection, self, embedder)
                except StoreError:
                    raise
                except Exception as error:
                    raise StoreError(
                        f"migrating the old embedded store {old} failed ({error}); it is "
                        "unchanged, and the next open migrates it again"
                    ) from error
        finally:
            if self._shard is None:
                self._lock.release()

    def _load_locked(self) -> edge.EdgeShard | None:
        """The shard, when `index.json` says it is complete; the caller holds the lock. A
        shard without it was left by a crash during a create or a migration: removed."""
        shard_dir = self.folder / _SHARD
        shutil.rmtree(self.folder / _NEW_SHARD, ignore_errors=True)
        if not (self.folder / FACTS_FILE).is_file():
            if shard_dir.exists():
                log.warning("removing %s: its create or migration did not finish", shard_dir)
                shutil.rmtree(shard_dir)
            return None
        if not shard_dir.is_dir():
            return None
        try:
            return edge.EdgeShard.load(str(shard_dir))
        except Exception as error:
            if "WouldBlock" in str(error) or "lock" in str(error).lower():
                raise StoreError(_already_open(self.folder)) from error
            raise StoreError(
                f"the embedded store {self.folder} cannot be opened: {error}"
            ) from error

    def _require(self) -> edge.EdgeShard:
        if self._shard is None:
            raise StoreError(f"no index in {self.folder}")
        return self._shard

    def exists(self) -> bool:
        if self._shard is None and not self._closed:
            self._look_again()
        return self._shard is not None

    def _look_again(self) -> None:
        """Take over an index that another process built since this one looked, once that
        process has let it go; at most once a second (a stat while there is none)."""
        now = time.monotonic()
        if now - self._looked < _LOOK_AGAIN_S:
            return
        self._looked = now
        if not (self.folder / FACTS_FILE).is_file() or not self._lock.acquire(timeout_s=0):
            return
        try:
            self._shard = self._load_locked()
        finally:
            if self._shard is None:
                self._lock.release()

    def facts(self) -> dict[str, Any]:
        try:
            data = json.loads((self.folder / FACTS_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise StoreMisconfigured(
                f"{self.folder / FACTS_FILE} is unreadable ({error}): re-index into a fresh "
                "SELFRAG_HOME"
            ) from error
        if not isinstance(data, dict):
            raise StoreMisconfigured(f"{self.folder / FACTS_FILE} is not an index description")
        return data

    def _write_facts(self, facts: dict[str, Any]) -> None:
        # Atomic and synced: a reader, or the folder after a crash, has the old file or the new.
        data = json.dumps(facts, indent=2, sort_keys=True).encode()
        write_atomic(self.folder / FACTS_FILE, data)

    def create(self, dim: int, facts: dict[str, Any]) -> None:
        """Create the shard, or take over the one another process created meanwhile (then
        `facts` are not written: the caller checks the existing ones)."""
        if self._shard is not None:
            return
        if not self._lock.acquire(timeout_s=0):
            log.warning("waiting for another process to close the embedded store %s", self.folder)
            if not self._lock.acquire(timeout_s=FIRST_INDEX_WAIT_S):
                raise StoreError(
                    f"{_already_open(self.folder)} (waited {FIRST_INDEX_WAIT_S:.0f} s for it)"
                )
        try:
            self._shard = self._load_locked()
            if self._shard is None:
                shard = _new_shard(self.folder / _SHARD, dim)
                try:
                    self._write_facts(facts)  # last: from now on the shard is an index
                except BaseException:
                    shard.close()
                    shutil.rmtree(self.folder / _SHARD, ignore_errors=True)
                    raise
                self._shard = shard
        finally:
            if self._shard is None:
                self._lock.release()

    def build(self, dim: int, facts: dict[str, Any], batches: Iterable[Sequence[PointData]]) -> int:
        """Write a whole index from `batches` into a shard of its own and switch to it only
        once it is complete; returns the points written. The caller holds the lock and this
        engine has no shard. On failure the new shard is closed and removed."""
        building = self.folder / _NEW_SHARD
        shutil.rmtree(building, ignore_errors=True)
        written = 0
        try:
            shard = _new_shard(building, dim)
            try:
                for points in batches:
                    if points:
                        shard.update(_upsert_operation(points))
                        written += len(points)
                shard.optimize()
                shard.flush()
            finally:
                shard.close()
            os.replace(building, self.folder / _SHARD)  # no shard there: _load_locked ran
            fsync_dir(self.folder)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        self._write_facts(facts)  # the switch: from now on the folder holds this index
        self._shard = edge.EdgeShard.load(str(self.folder / _SHARD))
        return written

    def update_facts(self, changes: dict[str, Any]) -> None:
        self._write_facts({**self.facts(), **changes})

    def upsert(self, points: Sequence[PointData]) -> None:
        self._require().update(_upsert_operation(points))

    def delete_stale(self, doc_ids: Sequence[str], keep: Sequence[str]) -> None:
        stale = edge.Filter(
            must=[edge.FieldCondition(key="doc_id", match=edge.MatchAny(list(doc_ids)))],
            must_not=[edge.HasIdCondition(set(keep))],
        )
        self._require().update(edge.UpdateOperation.delete_points_by_filter(stale))

    def finish_writes(self) -> None:
        shard = self._require()
        shard.optimize()  # builds the HNSW index once a segment is large enough
        shard.flush()

    def count(self) -> int:
        return int(self._require().count(edge.CountRequest(exact=True)))

    def search(self, searches: Sequence[Search]) -> list[list[tuple[dict[str, Any], float]]]:
        requests = [self._request(s) for s in searches]
        results = self._require().query_batch(edge.QueryBatchRequest(requests))
        return [[(dict(p.payload or {}), float(p.score)) for p in hits] for hits in results]

    @staticmethod
    def _request(s: Search) -> edge.QueryRequest:
        dense = edge.Query.Nearest(s.dense, using=DENSE)
        if s.terms is None or not s.terms.indices:
            # Not hybrid, or a query of stop words only: the sparse branch would find nothing.
            return edge.QueryRequest(limit=s.limit, query=dense, with_payload=True)
        terms = edge.SparseVector(s.terms.indices, s.terms.values)
        depth = _depth(s.limit)
        return edge.QueryRequest(
            limit=s.limit,
            prefetches=[
                edge.Prefetch(limit=depth, query=dense),
                edge.Prefetch(limit=depth, query=edge.Query.Nearest(terms, using=SPARSE)),
            ],
            query=edge.Fusion.Rrf(k=_RRF_K),
            with_payload=True,
        )

    def scroll(self, limit: int, offset: Any) -> tuple[list[dict[str, Any]], Any]:
        points, next_offset = self._require().scroll(
            edge.ScrollRequest(offset=offset, limit=limit, with_payload=True, with_vector=False)
        )
        return [dict(p.payload or {}) for p in points], next_offset

    def sample(self, limit: int) -> list[tuple[dict[str, Any], list[float]]]:
        """The first `limit` points in point order (random passages): payload, dense vector."""
        points, _ = self._require().scroll(
            edge.ScrollRequest(limit=limit, with_payload=True, with_vector=True)
        )
        return [(dict(p.payload or {}), list(_dense_of(p.vector))) for p in points]

    def ping(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")
        if self._shard is not None:
            self._shard.info()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._shard is not None:
                self._shard.close()
                self._shard = None
        finally:
            self._lock.release()
            with _OPEN_FOLDERS_LOCK:
                _OPEN_FOLDERS.discard(str(self.folder))


def _new_shard(path: Path, dim: int) -> edge.EdgeShard:
    """An empty shard at `path` with both vectors and the `doc_id` index."""
    path.parent.mkdir(parents=True, exist_ok=True)
    config = edge.EdgeConfig(
        vectors={DENSE: edge.EdgeVectorParams(size=dim, distance=edge.Distance.Cosine)},
        sparse_vectors={SPARSE: edge.EdgeSparseVectorParams(modifier=edge.Modifier.Idf)},
    )
    shard = edge.EdgeShard.create(str(path), config)
    try:
        shard.update(
            edge.UpdateOperation.create_field_index("doc_id", edge.PayloadSchemaType.Keyword)
        )
    except BaseException:
        shard.close()
        raise
    return shard


def _upsert_operation(points: Sequence[PointData]) -> edge.UpdateOperation:
    return edge.UpdateOperation.upsert_points(
        [
            edge.Point(
                id=p.id,
                vector={
                    DENSE: p.dense,
                    SPARSE: edge.SparseVector(p.sparse.indices, p.sparse.values),
                },
                payload=p.payload,
            )
            for p in points
        ]
    )


def migrate_local_store(old: Path, collection: str, target: EdgeEngine, embedder: Embedder) -> int:
    """Copy an index of the earlier format (qdrant-client local mode) into `target`: dense
    vectors and payloads as they are, BM25 vectors recomputed. Returns the passages copied; an
    index of another embedder is left alone (the open then finds no index). The caller holds
    `target`'s lock; `target` switches to the copy only once it is complete, so a failed or
    killed migration leaves no index behind, and the next open migrates again."""
    from qdrant_client import QdrantClient

    started = time.perf_counter()
    client = QdrantClient(path=str(old))
    try:
        info = client.get_collection(collection)
        built_with = (info.config.metadata or {}).get("embedding_model")
        accepted = {embedder.model_id, *replaced_by(embedder)}
        if built_with is not None and built_with not in accepted:
            log.warning(
                "the index in %s was built with %s, not %s: not migrated; re-index",
                old,
                built_with,
                embedder.model_id,
            )
            return 0

        def batches() -> Iterator[list[PointData]]:
            offset = None
            while True:
                records, offset = client.scroll(
                    collection, limit=256, offset=offset, with_payload=True, with_vectors=[DENSE]
                )
                points = []
                for r in records:
                    vector = r.vector[DENSE] if isinstance(r.vector, dict) else r.vector
                    payload = dict(r.payload or {})
                    text = str(payload.get("text", ""))
                    points.append(
                        PointData(str(r.id), list(vector), sparse.document_vector(text), payload)
                    )
                yield points
                if offset is None:
                    return

        # Built by an embedder this one replaces: recorded as such, so the first open checks
        # a sample of its vectors (QdrantStore._adopt) before using them.
        facts = {
            **new_facts(embedder),
            "index_version": uuid.uuid4().hex,
            "embedding_model": built_with or embedder.model_id,
        }
        copied = target.build(embedder.dim, facts, batches())
    finally:
        client.close()
    log.warning(
        "migrated %d passages from the old embedded store %s to Qdrant Edge in %.1f s; "
        "the old folder is no longer read and can be deleted",
        copied,
        old,
        time.perf_counter() - started,
    )
    return copied


def _dense_of(vector: Any) -> Sequence[float]:
    """The dense vector of a point as an engine returns it (by name, or alone)."""
    return vector[DENSE] if isinstance(vector, dict) else vector


def _already_open(folder: Path) -> str:
    return (
        f"the embedded Qdrant store {folder} is already open (one process and one store per "
        "folder): close() the other store first, or use a Qdrant server"
    )


# --- a Qdrant server, through qdrant-client ---------------------------------------------------


class ServerEngine:
    """A collection on a Qdrant server; its facts are the collection's metadata."""

    kind = "server"

    def __init__(self, settings: RetrievalSettings, client: QdrantClient | None = None) -> None:
        """`client`: one already made (tests pass qdrant-client's in-memory mode, which speaks
        the server's API); by default one for `settings.qdrant_url`."""
        from qdrant_client import QdrantClient, models

        self._models = models
        if client is None:
            key = settings.qdrant_api_key.get_secret_value() if settings.qdrant_api_key else None
            client = QdrantClient(url=settings.qdrant_url, api_key=key)
        self._client = client
        self._collection = settings.collection
        self.where = str(settings.qdrant_url)

    def exists(self) -> bool:
        return bool(self._client.collection_exists(self._collection))

    def facts(self) -> dict[str, Any]:
        config = self._client.get_collection(self._collection).config
        facts = dict(config.metadata or {})
        vectors = config.params.vectors
        dense = vectors.get(DENSE) if isinstance(vectors, dict) else None
        facts["dense_size"] = dense.size if dense is not None else None
        return facts

    def create(self, dim: int, facts: dict[str, Any]) -> None:
        m = self._models
        metadata = {k: v for k, v in facts.items() if k != "dense_size"}
        try:
            self._client.create_collection(
                self._collection,
                vectors_config={DENSE: m.VectorParams(size=dim, distance=m.Distance.COSINE)},
                sparse_vectors_config={SPARSE: m.SparseVectorParams(modifier=m.Modifier.IDF)},
                metadata=metadata,
            )
        except Exception:
            # Another process may have created it in the meantime (then it must match too);
            # anything else re-raises.
            if not self._client.collection_exists(self._collection):
                raise
        self._client.create_payload_index(
            self._collection, "doc_id", field_schema=m.PayloadSchemaType.KEYWORD
        )

    def update_facts(self, changes: dict[str, Any]) -> None:
        self._client.update_collection(self._collection, metadata=changes)

    def upsert(self, points: Sequence[PointData]) -> None:
        m = self._models
        self._client.upsert(
            self._collection,
            points=[
                m.PointStruct(
                    id=p.id,
                    vector={
                        DENSE: p.dense,
                        SPARSE: m.SparseVector(indices=p.sparse.indices, values=p.sparse.values),
                    },
                    payload=p.payload,
                )
                for p in points
            ],
            wait=True,
        )

    def delete_stale(self, doc_ids: Sequence[str], keep: Sequence[str]) -> None:
        m = self._models
        self._client.delete(
            self._collection,
            points_selector=m.FilterSelector(
                filter=m.Filter(
                    must=[m.FieldCondition(key="doc_id", match=m.MatchAny(any=list(doc_ids)))],
                    must_not=[m.HasIdCondition(has_id=list(keep))],
                )
            ),
            wait=True,
        )

    def finish_writes(self) -> None:
        """A server optimises in the background."""

    def count(self) -> int:
        return int(self._client.count(self._collection, exact=True).count)

    def search(self, searches: Sequence[Search]) -> list[list[tuple[dict[str, Any], float]]]:
        m = self._models
        requests = []
        for s in searches:
            if s.terms is None or not s.terms.indices:
                requests.append(
                    m.QueryRequest(query=s.dense, using=DENSE, limit=s.limit, with_payload=True)
                )
                continue
            depth = _depth(s.limit)
            terms = m.SparseVector(indices=s.terms.indices, values=s.terms.values)
            requests.append(
                m.QueryRequest(
                    prefetch=[
                        m.Prefetch(query=s.dense, using=DENSE, limit=depth),
                        m.Prefetch(query=terms, using=SPARSE, limit=depth),
                    ],
                    query=m.RrfQuery(rrf=m.Rrf(k=_RRF_K)),
                    limit=s.limit,
                    with_payload=True,
                )
            )
        responses = self._client.query_batch_points(self._collection, requests=requests)
        return [[(dict(p.payload or {}), float(p.score)) for p in r.points] for r in responses]

    def scroll(self, limit: int, offset: Any) -> tuple[list[dict[str, Any]], Any]:
        points, next_offset = self._client.scroll(
            self._collection, limit=limit, offset=offset, with_payload=True, with_vectors=False
        )
        return [dict(p.payload or {}) for p in points], next_offset

    def sample(self, limit: int) -> list[tuple[dict[str, Any], list[float]]]:
        """The first `limit` points in point order (random passages): payload, dense vector."""
        points, _ = self._client.scroll(
            self._collection, limit=limit, with_payload=True, with_vectors=[DENSE]
        )
        return [(dict(p.payload or {}), list(_dense_of(p.vector))) for p in points]

    def ping(self) -> None:
        self._client.get_collections()

    def close(self) -> None:
        self._client.close()
