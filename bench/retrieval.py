"""Retrieval benchmark: index the sample corpus, then ask the SQuAD "Normans" questions.

Indexes `squad_v2_small.json` (87 paragraphs) plus `wiki_sample_1000.jsonl` (1,000 distractor
passages) into a temporary embedded store and reports, over the answerable Normans questions,
how often a passage of the gold paragraph comes first (hit@1) or within the top 5 (hit@5),
for dense and for hybrid (dense + BM25, RRF) search. The Computational_complexity_theory
questions are the held-out test split and are never read here.

    .venv/bin/python -m bench.retrieval [--data ../shared/data] [--threads 1]   (from the repo root)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from selfrag.infra.embedder import SentenceEmbedder
from selfrag.infra.qdrant_store import QdrantStore
from selfrag.jobs.indexing import index_corpus
from selfrag.schemas.settings import RetrievalSettings

TUNING_ARTICLE = "Normans"
TOP_K = 5


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


def evaluate(store: QdrantStore, questions: list[tuple[str, str]]) -> tuple[float, float, float]:
    """(hit@1, hit@5, ms per query), by document: any window of the gold paragraph counts."""
    hit1 = hit5 = 0
    started = time.perf_counter()
    for question, gold in questions:
        docs = [p.metadata.get("doc_id", p.id) for p in store.search(question, TOP_K)]
        hit1 += bool(docs) and docs[0] == gold
        hit5 += gold in docs
    ms = (time.perf_counter() - started) * 1000 / len(questions)
    return hit1 / len(questions), hit5 / len(questions), ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_data = Path(__file__).resolve().parents[2] / "shared" / "data"
    parser.add_argument("--data", type=Path, default=default_data)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for embedding")
    args = parser.parse_args()
    squad = args.data / "squad_v2_small.json"
    wiki = args.data / "wiki_sample_1000.jsonl"
    questions = normans_questions(squad)

    embedder = SentenceEmbedder(threads=args.threads)
    started = time.perf_counter()
    _ = embedder.dim  # load the model outside the indexing time
    load_s = time.perf_counter() - started

    settings = RetrievalSettings()
    with tempfile.TemporaryDirectory() as home:
        with QdrantStore.open(settings, Path(home), embedder) as store:
            started = time.perf_counter()
            reports = [index_corpus(path, store, progress=False) for path in (squad, wiki)]
            index_s = time.perf_counter() - started
            documents = sum(r.documents for r in reports)
            passages = store.count()
            errors = sum(len(r.errors) for r in reports)
            dense = evaluate(store, questions)
        hybrid_settings = settings.model_copy(update={"hybrid": True})
        with QdrantStore.open(hybrid_settings, Path(home), embedder) as store:
            hybrid = evaluate(store, questions)

    print(f"corpus: {documents} documents, {passages} passages, {errors} errors")
    print(
        f"model load {load_s:.1f} s, indexing {index_s:.1f} s "
        f"({passages / index_s:.1f} passages/s, {args.threads} torch thread(s))"
    )
    print(f"questions: {len(questions)} answerable '{TUNING_ARTICLE}' questions\n")
    print(f"{'search':<8} {'hit@1':>7} {'hit@5':>7} {'ms/query':>9}")
    for name, (h1, h5, ms) in (("dense", dense), ("hybrid", hybrid)):
        print(f"{name:<8} {h1:>7.3f} {h5:>7.3f} {ms:>9.1f}")
    print(
        f"index_s={index_s:.1f} documents={documents} passages={passages} "
        f"questions={len(questions)} hit1={dense[0]:.3f} hit5={dense[1]:.3f} "
        f"hybrid_hit1={hybrid[0]:.3f} hybrid_hit5={hybrid[1]:.3f} "
        f"dense_ms={dense[2]:.1f} hybrid_ms={hybrid[2]:.1f}"
    )


if __name__ == "__main__":
    main()
