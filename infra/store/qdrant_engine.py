"""What `QdrantStore` (infra.store.qdrant_store) and its two engines, Qdrant Edge in this process
(infra.store.qdrant_edge) and a Qdrant server (infra.store.qdrant_server), share: the `Engine`
interface,
the points and queries that pass through it, the store's errors, and the collection's layout.

Layout (one collection, `RetrievalSettings.collection`):
- named dense vector `dense` (cosine, the embedder's width) and named sparse vector `sparse`
  (Qdrant's BM25, `infra.store.sparse`, IDF applied by the engine). Both are always written, so
  `hybrid` can be switched on later without re-indexing.
- point id = uuid5 of the passage id, so re-indexing the same passage overwrites it.
- payload `{passage_id, title, text, doc_id, url?, source?, doc_title?, page?, section?,
  indexed_at?}` (each optional one when the corpus gave it), with a keyword index on `doc_id`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from selfrag.infra.store import sparse
from selfrag.schemas.settings import HybridFusion

DENSE = "dense"
SPARSE = "sparse"
RRF_K = 60  # Qdrant's default RRF constant
# Each branch of a hybrid query fetches this many times `k` before fusion, so a passage ranked
# a little lower by one method can still be lifted by the other.
_HYBRID_PREFETCH_FACTOR = 4
_HYBRID_PREFETCH_MIN = 20
# Hits fetched past `k`, so that passages tied with the k-th are all seen and the tie is
# broken by `search_order`, not by how an index build left its points or by the limit asked
# for (Qdrant orders a tie by both). RRF gives two passages exactly equal scores when their
# dense and BM25 ranks are swapped, or when each is found by one branch alone at the same
# rank: a tie holds two passages.
TIE_MARGIN = 2
# Fixed namespace: the same passage id maps to the same point id on every machine.
_POINT_NAMESPACE = uuid.UUID("6f1c3a52-2d4e-5b8a-9c0e-51f0a7b3d9e4")


class Embedder(Protocol):
    """What the store needs from an embedding model."""

    @property
    def dim(self) -> int: ...

    @property
    def model_id(self) -> str: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


class StoreError(RuntimeError):
    """The store cannot be opened or used."""


class StoreHeld(StoreError):
    """The embedded store is open in another process (`holder`: its pid and command, when
    known) or in another store of this one."""

    def __init__(self, message: str, holder: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder


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
class Hit:
    """One search result: the point's payload, its score (cosine similarity, or the fused
    score of a hybrid query) and its dense vector."""

    payload: dict[str, Any]
    score: float
    dense: Sequence[float]


@dataclass(frozen=True)
class Search:
    """One query: its dense vector and, for hybrid search, its BM25 terms, how many hits each
    branch fetches (`depth`) and how the two result lists are fused."""

    dense: list[float]
    terms: sparse.SparseVec | None
    limit: int
    fusion: HybridFusion
    depth: int

    @classmethod
    def of(
        cls, dense: list[float], terms: sparse.SparseVec | None, k: int, fusion: HybridFusion
    ) -> Search:
        """The query for the `k` best passages: `TIE_MARGIN` hits more, each branch as deep as
        `k` needs (`prefetch_depth`), so the margin changes no fused score."""
        return cls(dense, terms, k + TIE_MARGIN, fusion, prefetch_depth(k))


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

    def delete_documents(self, doc_ids: Sequence[str]) -> None: ...

    def finish_writes(self) -> None: ...

    def count(self) -> int: ...

    def search(self, searches: Sequence[Search]) -> list[list[Hit]]: ...

    def scroll(self, limit: int, offset: Any) -> tuple[list[dict[str, Any]], Any]: ...

    def sample(self, limit: int) -> list[tuple[dict[str, Any], list[float]]]: ...

    def ping(self) -> None: ...

    def close(self) -> None: ...


def prefetch_depth(k: int) -> int:
    """How many hits each branch of a hybrid query fetches before fusion, for `k` results."""
    return max(k * _HYBRID_PREFETCH_FACTOR, _HYBRID_PREFETCH_MIN)


def search_order(score: float, similarity: float, passage_id: str) -> tuple[float, float, str]:
    """The sort key of a hit, best first: its score; among equal scores the lower cosine
    similarity, then the passage id, so that a tie ranks the same on every index build.

    Two passages tie under RRF when the dense and BM25 lists rank them the other way round, or
    when each list alone finds one of them at the same rank; either way the less similar one
    is the one BM25 ranks higher. The tie goes to the keyword match, the better of the two on
    questions written from a passage (notes/benchmarks.md, "RRF ties")."""
    return (-score, similarity, passage_id)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two dense vectors, to 6 decimals (one text embedded twice can
    differ in the last bits, and a search repeated should give the same passages); 0 when
    either is zero."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = float(np.linalg.norm(x) * np.linalg.norm(y))
    return round(float(x @ y) / norms, 6) if norms > 0.0 else 0.0


def dense_of(vector: Any) -> Sequence[float]:
    """The dense vector of a point as an engine returns it (by name, or alone)."""
    return vector[DENSE] if isinstance(vector, dict) else vector
