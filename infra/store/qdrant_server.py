"""A collection on a Qdrant server (`retrieval.qdrant_url`), through qdrant-client."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from selfrag.infra.store.qdrant_engine import (
    DENSE,
    RRF_K,
    SPARSE,
    Hit,
    PointData,
    Search,
    dense_of,
)
from selfrag.schemas.settings import RetrievalSettings

if TYPE_CHECKING:
    from qdrant_client import QdrantClient


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

    def delete_documents(self, doc_ids: Sequence[str]) -> None:
        m = self._models
        self._client.delete(
            self._collection,
            points_selector=m.FilterSelector(
                filter=m.Filter(
                    must=[m.FieldCondition(key="doc_id", match=m.MatchAny(any=list(doc_ids)))]
                )
            ),
            wait=True,
        )

    def finish_writes(self) -> None:
        """A server optimises in the background."""

    def count(self) -> int:
        return int(self._client.count(self._collection, exact=True).count)

    def search(self, searches: Sequence[Search]) -> list[list[Hit]]:
        m = self._models
        requests = []
        for s in searches:
            if s.terms is None or not s.terms.indices:
                requests.append(
                    m.QueryRequest(
                        query=s.dense,
                        using=DENSE,
                        limit=s.limit,
                        with_payload=True,
                        with_vector=[DENSE],
                    )
                )
                continue
            terms = m.SparseVector(indices=s.terms.indices, values=s.terms.values)
            requests.append(
                m.QueryRequest(
                    prefetch=[
                        m.Prefetch(query=s.dense, using=DENSE, limit=s.depth),
                        m.Prefetch(query=terms, using=SPARSE, limit=s.depth),
                    ],
                    query=(
                        m.RrfQuery(rrf=m.Rrf(k=RRF_K))
                        if s.fusion == "rrf"
                        else m.FusionQuery(fusion=m.Fusion.DBSF)
                    ),
                    limit=s.limit,
                    with_payload=True,
                    with_vector=[DENSE],
                )
            )
        responses = self._client.query_batch_points(self._collection, requests=requests)
        return [
            [Hit(dict(p.payload or {}), float(p.score), dense_of(p.vector)) for p in r.points]
            for r in responses
        ]

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
        return [(dict(p.payload or {}), list(dense_of(p.vector))) for p in points]

    def ping(self) -> None:
        self._client.get_collections()

    def close(self) -> None:
        self._client.close()
