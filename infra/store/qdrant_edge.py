"""The embedded store: one Qdrant Edge shard in this process, in `home/edge/<collection>/`.

The folder belongs to one process: the one that holds its `.lock` (flock, with the shard open),
so a second open, here or in another process, is refused (StoreError). Use a Qdrant server for
several processes. A folder with no index yet is not held: the first write takes the lock
(waiting while another process that created the index meanwhile still holds it, then writing
into that index), and a process that opened it empty takes over an index built later by another
one, once that one has closed it (looked for at most once a second). The index's facts
(infra.store.qdrant_facts) are in `index.json` beside the shard, replaced atomically and written
last, so a shard without it, left by a crash, is removed and created again. An embedded index
of the earlier format (qdrant-client's local mode in `home/qdrant/`) is migrated on first open
(infra.store.qdrant_migration) into a shard of its own, switched to only once complete: dense
vectors and payloads are copied, the BM25 vectors recomputed; nothing is embedded again. A
migration that fails or is killed leaves no index, and the next open starts it again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import qdrant_edge as edge

from selfrag.infra.file_lock import FileLock, fsync_dir, write_atomic
from selfrag.infra.store.qdrant_engine import (
    DENSE,
    RRF_K,
    SPARSE,
    Embedder,
    Hit,
    PointData,
    Search,
    StoreError,
    StoreHeld,
    StoreMisconfigured,
    dense_of,
)
from selfrag.infra.store.qdrant_migration import migrate_local_store
from selfrag.infra.store.store_holder import held_error, record_holder

log = logging.getLogger("selfrag.store")

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
# Embedded folders this process has open (resolved paths), to refuse a second store early.
_OPEN_FOLDERS: set[str] = set()
_OPEN_FOLDERS_LOCK = threading.Lock()


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
                raise held_error(folder)
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
            raise held_error(self.folder)
        try:
            self._shard = self._load_locked()
            if self._shard is None and (old / "collection" / collection).is_dir():
                try:
                    migrate_local_store(old, collection, self.build, embedder)
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
            shard = edge.EdgeShard.load(str(shard_dir))
        except Exception as error:
            if "WouldBlock" in str(error) or "lock" in str(error).lower():
                raise held_error(self.folder) from error
            raise StoreError(
                f"the embedded store {self.folder} cannot be opened: {error}"
            ) from error
        record_holder(self.folder)
        return shard

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
                held = held_error(self.folder)
                raise StoreHeld(f"{held} (waited {FIRST_INDEX_WAIT_S:.0f} s for it)", held.holder)
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
                record_holder(self.folder)
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
        record_holder(self.folder)
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

    def delete_documents(self, doc_ids: Sequence[str]) -> None:
        gone = edge.Filter(
            must=[edge.FieldCondition(key="doc_id", match=edge.MatchAny(list(doc_ids)))]
        )
        self._require().update(edge.UpdateOperation.delete_points_by_filter(gone))

    def finish_writes(self) -> None:
        shard = self._require()
        shard.optimize()  # builds the HNSW index once a segment is large enough
        shard.flush()

    def count(self) -> int:
        return int(self._require().count(edge.CountRequest(exact=True)))

    def search(self, searches: Sequence[Search]) -> list[list[Hit]]:
        requests = [self._request(s) for s in searches]
        results = self._require().query_batch(edge.QueryBatchRequest(requests))
        return [
            [Hit(dict(p.payload or {}), float(p.score), dense_of(p.vector)) for p in hits]
            for hits in results
        ]

    @staticmethod
    def _request(s: Search) -> edge.QueryRequest:
        dense = edge.Query.Nearest(s.dense, using=DENSE)
        if s.terms is None or not s.terms.indices:
            # Not hybrid, or a query of stop words only: the sparse branch would find nothing.
            return edge.QueryRequest(
                limit=s.limit, query=dense, with_payload=True, with_vector=[DENSE]
            )
        terms = edge.SparseVector(s.terms.indices, s.terms.values)
        return edge.QueryRequest(
            limit=s.limit,
            prefetches=[
                edge.Prefetch(limit=s.depth, query=dense),
                edge.Prefetch(limit=s.depth, query=edge.Query.Nearest(terms, using=SPARSE)),
            ],
            query=edge.Fusion.Rrf(k=RRF_K) if s.fusion == "rrf" else edge.Fusion.Dbsf(),
            with_payload=True,
            with_vector=[DENSE],
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
        return [(dict(p.payload or {}), list(dense_of(p.vector))) for p in points]

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
