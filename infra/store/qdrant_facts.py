"""What an index records about how it was built, and whether an embedder may use it.

The facts `{format, index_version, embedding_model, sparse_scheme, dense_size}` live on a
server in the collection's metadata (every process sharing it sees the same version) and on
the embedded store in `index.json` beside the shard. An index is refused (StoreMisconfigured)
when another embedding model, BM25 scheme or format built it, or its vectors have another size;
one built by an embedder the current one replaces (`Embedder.replaces`) is reused once a sample
of its passages re-embeds alike.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from selfrag.infra.store import sparse
from selfrag.infra.store.qdrant_engine import DENSE, Embedder, Engine, StoreMisconfigured

log = logging.getLogger("selfrag.store")

INDEX_FORMAT = 2
"""1: qdrant-client local mode with selfrag's own BM25; 2: Qdrant Edge with Qdrant's BM25."""
NO_VERSION = "empty"
"""The index version of a collection that does not exist or has no content yet."""
# An index recorded as built by an embedder the current one replaces (`Embedder.replaces`) is
# reused when this many of its passages re-embed to vectors this close to the stored ones.
ADOPT_SAMPLE = 32
ADOPT_MIN_COSINE = 0.999


def replaced_by(embedder: Embedder) -> frozenset[str]:
    """The ids of embedders whose indexes `embedder` may reuse after a sample check (its
    optional `replaces` attribute; none for an embedder without one)."""
    return frozenset(getattr(embedder, "replaces", ()))


def new_facts(embedder: Embedder) -> dict[str, Any]:
    """The facts of an index this code writes, before its first content."""
    return {
        "format": INDEX_FORMAT,
        "index_version": NO_VERSION,
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


def adopt(
    engine: Engine, collection: str, embedder: Embedder, facts: dict[str, Any]
) -> dict[str, Any]:
    """Take over an index built by an embedder `embedder` replaces: re-embed a sample of its
    passages, and when every vector matches the stored one (cosine >= 0.999) record `embedder`
    as the index's and return the facts so changed; StoreMisconfigured naming the fix
    otherwise."""
    built_with = facts["embedding_model"]
    sample = engine.sample(ADOPT_SAMPLE)
    worst = 1.0
    if sample:
        fresh = embedder.embed([str(payload.get("text", "")) for payload, _ in sample])
        stored = np.asarray([vector for _, vector in sample], dtype=np.float32)
        norms = np.linalg.norm(fresh, axis=1) * np.linalg.norm(stored, axis=1)
        worst = float(np.min(np.sum(fresh * stored, axis=1) / np.maximum(norms, 1e-12)))
    if worst < ADOPT_MIN_COSINE:
        raise StoreMisconfigured(
            f"collection {collection!r} in {engine.where} was indexed with {built_with}, "
            f"whose vectors the embedder {embedder.model_id} does not reproduce "
            f"(cosine {worst:.4f} < {ADOPT_MIN_COSINE} on a sample of {len(sample)} "
            "passages): re-index, e.g. `selfrag --home NEW_HOME index PATH...` (or set "
            "retrieval.collection to a new name)"
        )
    engine.update_facts({"embedding_model": embedder.model_id})
    log.warning(
        "collection %r was indexed with %s; %s re-embeds %d of its passages alike "
        "(cosine >= %.6f): reused, and recorded as indexed with %s",
        collection,
        built_with,
        embedder.model_id,
        len(sample),
        worst,
        embedder.model_id,
    )
    return {**facts, "embedding_model": embedder.model_id}
