"""BM25 sparse vectors for hybrid search: Qdrant's own BM25 (`qdrant_edge.Bm25`, the model the
Qdrant server's BM25 inference runs), for the embedded and the server store alike.

Documents carry BM25's term-frequency part, queries 1.0 per distinct term, and Qdrant applies
the IDF (`Modifier.IDF` on the sparse vector), so the dot product is a BM25 score. Changing the
configuration changes the stored vectors: `SCHEME` names it, and an index written under another
scheme is refused (re-index).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import qdrant_edge

K1 = 1.2
B = 0.75
# BM25 needs the corpus's average document length; Qdrant takes it as configuration. Passages
# of 100-150 words average about 64 tokens once stop words are dropped (measured on the SQuAD
# + Wikipedia sample corpus); Qdrant's default of 256 would under-weight term frequency.
AVERAGE_LENGTH = 64.0
LANGUAGE = "english"  # English stop words and Snowball stemming
SCHEME = f"qdrant-bm25 {LANGUAGE} k={K1} b={B} avg_len={AVERAGE_LENGTH:g}"


@dataclass(frozen=True)
class SparseVec:
    """Sorted unique `indices` and their `values`."""

    indices: list[int]
    values: list[float]


_model: qdrant_edge.Bm25 | None = None
_model_lock = threading.Lock()


def _bm25() -> qdrant_edge.Bm25:
    global _model
    with _model_lock:
        if _model is None:
            _model = qdrant_edge.Bm25(
                qdrant_edge.Bm25Config(k=K1, b=B, avg_len=AVERAGE_LENGTH, language=LANGUAGE)
            )
        return _model


def _vec(v: qdrant_edge.SparseVector) -> SparseVec:
    pairs = sorted(zip(v.indices, v.values, strict=True))
    return SparseVec([i for i, _ in pairs], [float(x) for _, x in pairs])


def document_vector(text: str) -> SparseVec:
    """The BM25 term weights of a passage (empty for text of stop words only)."""
    return _vec(_bm25().embed_document(text))


def query_vector(text: str) -> SparseVec:
    """1.0 per distinct query term; empty when the query has only stop words."""
    return _vec(_bm25().embed_query(text))
