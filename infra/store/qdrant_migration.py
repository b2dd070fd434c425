"""Migrating an embedded index of the earlier format (qdrant-client's local mode in
`home/qdrant/`) into a Qdrant Edge shard (infra.store.qdrant_edge)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from selfrag.infra.store import sparse
from selfrag.infra.store.qdrant_engine import DENSE, Embedder, PointData
from selfrag.infra.store.qdrant_facts import new_facts, replaced_by

BuildIndex = Callable[[int, dict[str, Any], Iterable[Sequence[PointData]]], int]
"""`EdgeEngine.build`: a new index of that dimension and facts from those batches."""

log = logging.getLogger("selfrag.store")


def migrate_local_store(old: Path, collection: str, build: BuildIndex, embedder: Embedder) -> int:
    """Copy an index of the earlier format (qdrant-client local mode) through `build` (the
    target `EdgeEngine.build`): dense vectors and payloads as they are, BM25 vectors
    recomputed. Returns the passages copied; an index of another embedder is left alone (the
    open then finds no index). The caller holds the target's lock; the target switches to the
    copy only once it is complete, so a failed or killed migration leaves no index behind, and
    the next open migrates again."""
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
        # a sample of its vectors (infra.store.qdrant_facts.adopt) before using them.
        facts = {
            **new_facts(embedder),
            "index_version": uuid.uuid4().hex,
            "embedding_model": built_with or embedder.model_id,
        }
        copied = build(embedder.dim, facts, batches())
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
