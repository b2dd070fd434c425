"""Retrieval benchmark: search quality on the sample corpus, and the embedded store's engine
(Qdrant Edge) against qdrant-client's local mode, side by side in one run.

1. Quality: indexes `squad_v2_small.json` (87 paragraphs) plus `wiki_sample_1000.jsonl` (1,000
   passages) into a temporary embedded store and reports, over the answerable questions of the
   tuning sets (SQuAD's Normans article, and the `tune` split of `bench/data/wiki_questions.jsonl`
   over the Wikipedia passages), how often a passage of the gold document comes first (hit@1)
   or within the top 5 (hit@5), for dense search and for hybrid (dense + BM25) search fused by
   RRF and by DBSF, with the indexing time and query latency through `QdrantStore` (embedding
   included). The held-out sets (Computational_complexity_theory, the `report` split) are
   never read.
2. The store alone, with random unit vectors of the embedder's width (no embedding): for each
   size (the corpus's, and `--points`), the time to write every point and the p50/p95 latency
   of a top-5 dense query, for Qdrant Edge (HNSW, what selfrag uses) and qdrant-client's
   local mode (what it used before: every point in Python, scanned per query).

Last line: name=value.

    .venv/bin/python -m bench.retrieval [--data ../shared/data] [--threads 1] [--points 100000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from selfrag.infra.embeddings.embedder import SentenceEmbedder
from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.jobs.indexing import index_corpus
from selfrag.schemas.settings import RetrievalSettings

TUNING_ARTICLE = "Normans"
WIKI_QUESTIONS = Path(__file__).resolve().parent / "data" / "wiki_questions.jsonl"
TOP_K = 5
QUERIES = 200  # per store and size in part 2
WRITE_BATCH = 256


def wiki_tune_questions(path: Path) -> list[tuple[str, str]]:
    """(question, gold document id) for every answerable question of the wiki set's tuning
    split."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [
        (r["question"], r["passage_id"]) for r in rows if r["answerable"] and r["split"] == "tune"
    ]


def normans_questions(squad_path: Path) -> list[tuple[str, str]]:
    """(question, gold document id) for every answerable question of the Normans article."""
    data = json.loads(squad_path.read_text(encoding="utf-8"))
    questions = []
    for article in data["data"]:
        if article["title"] != TUNING_ARTICLE:
            continue  # the other article is the held-out test split
        for p, paragraph in enumerate(article["paragraphs"]):
            for qa in paragraph["qas"]:
                if not qa.get("is_impossible", False):
                    questions.append((qa["question"], f"squad:{article['title']}:{p}"))
    return questions


def evaluate(
    store: QdrantStore, questions: list[tuple[str, str]]
) -> tuple[float, float, float, float]:
    """(hit@1, hit@5, p50 ms, p95 ms), by document: any window of the gold paragraph counts."""
    hit1 = hit5 = 0
    ms = []
    for question, gold in questions:
        started = time.perf_counter()
        found = store.search(question, TOP_K)
        ms.append((time.perf_counter() - started) * 1000)
        docs = [p.metadata.get("doc_id", p.id) for p in found]
        hit1 += bool(docs) and docs[0] == gold
        hit5 += gold in docs
    n = len(questions)
    return hit1 / n, hit5 / n, _pct(ms, 50), _pct(ms, 95)


def _pct(values: list[float], q: int) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def edge_store(folder: Path, vectors: np.ndarray) -> tuple[float, Callable[[list[float]], None]]:
    """Write `vectors` into a Qdrant Edge shard; (seconds, query function)."""
    import qdrant_edge as edge

    config = edge.EdgeConfig(
        vectors={
            "dense": edge.EdgeVectorParams(size=vectors.shape[1], distance=edge.Distance.Cosine)
        }
    )
    shard = edge.EdgeShard.create(str(folder), config)
    started = time.perf_counter()
    for start in range(0, len(vectors), WRITE_BATCH):
        points = [
            edge.Point(id=str(uuid.uuid4()), vector={"dense": v.tolist()}, payload={"i": start + i})
            for i, v in enumerate(vectors[start : start + WRITE_BATCH])
        ]
        shard.update(edge.UpdateOperation.upsert_points(points))
    shard.optimize()  # the HNSW index, as QdrantStore builds it after indexing
    shard.flush()
    seconds = time.perf_counter() - started

    def query(v: list[float]) -> None:
        shard.query(
            edge.QueryRequest(
                limit=TOP_K, query=edge.Query.Nearest(v, using="dense"), with_payload=True
            )
        )

    return seconds, query


def local_store(folder: Path, vectors: np.ndarray) -> tuple[float, Callable[[list[float]], None]]:
    """Write `vectors` into qdrant-client's local mode; (seconds, query function)."""
    from qdrant_client import QdrantClient, models

    client = QdrantClient(path=str(folder))
    client.create_collection(
        "bench",
        vectors_config={
            "dense": models.VectorParams(size=vectors.shape[1], distance=models.Distance.COSINE)
        },
    )
    started = time.perf_counter()
    for start in range(0, len(vectors), WRITE_BATCH):
        points = [
            models.PointStruct(id=str(uuid.uuid4()), vector={"dense": v.tolist()}, payload={"i": i})
            for i, v in enumerate(vectors[start : start + WRITE_BATCH])
        ]
        client.upsert("bench", points=points, wait=True)
    seconds = time.perf_counter() - started

    def query(v: list[float]) -> None:
        client.query_points("bench", query=v, using="dense", limit=TOP_K, with_payload=True)

    return seconds, query


def store_alone(size: int, dim: int, rng: np.random.Generator) -> dict[str, tuple[float, ...]]:
    """{engine: (write s, p50 ms, p95 ms)} for `size` random points."""
    vectors = _unit(rng, size, dim)
    queries = _unit(rng, QUERIES, dim)
    out = {}
    for name, build in (("edge", edge_store), ("local", local_store)):
        with tempfile.TemporaryDirectory() as folder:
            seconds, query = build(Path(folder), vectors)
            ms = []
            for q in queries:
                started = time.perf_counter()
                query(q.tolist())
                ms.append((time.perf_counter() - started) * 1000)
            out[name] = (seconds, _pct(ms, 50), _pct(ms, 95))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_data = Path(__file__).resolve().parents[2] / "shared" / "data"
    parser.add_argument("--data", type=Path, default=default_data)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads for embedding")
    parser.add_argument("--points", type=int, default=100_000, help="the large store size")
    parser.add_argument(
        "--chunking",
        choices=("structure", "words"),
        default=RetrievalSettings().chunking,
        help="how documents become passages (retrieval.chunking)",
    )
    parser.add_argument("--quality-only", action="store_true", help="skip part 2")
    args = parser.parse_args()
    squad = args.data / "squad_v2_small.json"
    wiki = args.data / "wiki_sample_1000.jsonl"
    question_sets = {
        TUNING_ARTICLE: normans_questions(squad),
        "wiki_tune": wiki_tune_questions(WIKI_QUESTIONS),
    }

    embedder = SentenceEmbedder(threads=args.threads)
    started = time.perf_counter()
    embedder.embed(["load"])  # convert (once) and load the model outside the indexing time
    load_s = time.perf_counter() - started

    searches = {
        "dense": {"hybrid": False},
        "rrf": {"hybrid": True, "fusion": "rrf"},
        "dbsf": {"hybrid": True, "fusion": "dbsf"},
    }
    settings = RetrievalSettings(hybrid=False, chunking=args.chunking)
    quality: dict[str, dict[str, tuple[float, float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as home:
        with QdrantStore.open(settings, Path(home), embedder) as store:
            started = time.perf_counter()
            reports = [
                index_corpus(path, store, progress=False, retrieval=settings)
                for path in (squad, wiki)
            ]
            index_s = time.perf_counter() - started
            documents = sum(r.documents for r in reports)
            passages = store.count()
            errors = sum(len(r.errors) for r in reports)
        for search, update in searches.items():
            searching = settings.model_copy(update=update)
            with QdrantStore.open(searching, Path(home), embedder) as store:
                quality[search] = {
                    name: evaluate(store, questions) for name, questions in question_sets.items()
                }

    print(f"corpus: {documents} documents, {passages} passages, {errors} errors")
    print(
        f"model load {load_s:.1f} s, indexing {index_s:.1f} s "
        f"({passages / index_s:.1f} passages/s, {args.threads} embedding thread(s))"
    )
    for name, questions in question_sets.items():
        print(f"\n{name}: {len(questions)} answerable questions")
        print(f"{'search':<8} {'hit@1':>7} {'hit@5':>7} {'p50 ms':>7} {'p95 ms':>7}")
        for search, by_set in quality.items():
            h1, h5, p50, p95 = by_set[name]
            print(f"{search:<8} {h1:>7.3f} {h5:>7.3f} {p50:>7.1f} {p95:>7.1f}")

    rng = np.random.default_rng(0)
    sizes = [] if args.quality_only else sorted({passages, args.points})
    alone = {size: store_alone(size, embedder.dim, rng) for size in sizes}
    if alone:
        print(f"\nstore alone ({embedder.dim}-d random vectors, top-{TOP_K}, {QUERIES} queries)")
        print(f"{'points':>8} {'engine':<6} {'write s':>8} {'p50 ms':>7} {'p95 ms':>7}")
    for size, engines in alone.items():
        for name, (seconds, p50, p95) in engines.items():
            print(f"{size:>8} {name:<6} {seconds:>8.1f} {p50:>7.2f} {p95:>7.2f}")

    figures = {
        "chunking": args.chunking,
        "index_s": f"{index_s:.1f}",
        "passages": str(passages),
        **{f"{name}_questions": str(len(questions)) for name, questions in question_sets.items()},
        **{
            f"{search}_{name}_hit{k}": f"{by_set[name][i]:.3f}"
            for search, by_set in quality.items()
            for name in question_sets
            for i, k in ((0, 1), (1, 5))
        },
        **{
            f"{search}_p50_ms": f"{by_set[TUNING_ARTICLE][2]:.1f}"
            for search, by_set in quality.items()
        },
    }
    for size, engines in alone.items():
        for name, (seconds, p50, p95) in engines.items():
            figures[f"{name}_{size}_write_s"] = f"{seconds:.1f}"
            figures[f"{name}_{size}_p50_ms"] = f"{p50:.2f}"
            figures[f"{name}_{size}_p95_ms"] = f"{p95:.2f}"
        edge_p50, local_p50 = engines["edge"][1], engines["local"][1]
        figures[f"local_over_edge_p50_{size}"] = f"{local_p50 / edge_p50:.1f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
