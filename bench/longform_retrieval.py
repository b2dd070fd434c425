"""How much of a long-form question one search for the question alone finds: the baseline that
retrieving again for what is still missing has to beat.

Indexes the README's corpus (`squad_v2_small.json` and `wiki_sample_1000.jsonl`) for the wiki
and biography sets, and README.md plus docs/ for the docs set, each into a temporary embedded
store with the default retrieval settings (hybrid search), searches every question of
`bench/data/longform_*.jsonl` once with its own text, and counts the facts stated by a top-k
passage (any of the fact's answers, SQuAD-normalised and word-bounded, as `selfrag eval`
credits a passage). A set whose questions are mostly covered by that one search would not test
re-retrieval; the sets were written so that most are not (bench/data/README.md).

Last line: name=value.

    .venv/bin/python -m bench.longform_retrieval [--top-k 3] [--data ../shared/data] [--set wiki]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.data.longform import LONGFORM_BIO, LONGFORM_DOCS, LONGFORM_WIKI, REPO, SPLITS
from bench.data.questions import load
from selfrag.infra.embeddings.embedder import SentenceEmbedder
from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.jobs.indexing import index_corpus
from selfrag.pipeline.evaluation.qa_metrics import contains_answer
from selfrag.schemas.settings import RetrievalSettings

SETS = {"wiki": LONGFORM_WIKI, "bio": LONGFORM_BIO, "docs": LONGFORM_DOCS}


def found_facts(record: dict[str, Any], texts: Sequence[str]) -> list[str]:
    """The ids of the record's facts that one of `texts` states."""
    return [
        f["id"] for f in record["facts"] if any(contains_answer(t, f["answers"]) for t in texts)
    ]


def search(corpora: Sequence[Path], questions: list[str], top_k: int) -> list[list[str]]:
    """The top-k passage texts for each question, from a fresh store of `corpora`."""
    settings = RetrievalSettings()
    with tempfile.TemporaryDirectory() as home:
        with QdrantStore.open(settings, Path(home), SentenceEmbedder()) as store:
            for path in corpora:
                index_corpus(path, store, progress=False, retrieval=settings)
            return [[p.text for p in hits] for hits in store.search_many(questions, top_k)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--set", dest="sets", nargs="+", choices=sorted(SETS), default=list(SETS))
    args = parser.parse_args()
    corpora = {
        "wiki": [args.data / "squad_v2_small.json", args.data / "wiki_sample_1000.jsonl"],
        "docs": [REPO / "README.md", REPO / "docs"],
    }
    k, summary = args.top_k, []
    for name in args.sets:
        records = load(SETS[name])
        hits = search(
            corpora["docs" if name == "docs" else "wiki"], [r["question"] for r in records], k
        )
        rows = [(r, found_facts(r, texts)) for r, texts in zip(records, hits, strict=True)]
        for r, found in rows:
            print(f"{r['id']:<13} {r['split']:<6} {len(found)}/{len(r['facts'])} {','.join(found)}")
        for split in (*SPLITS, None):
            part = [(r, f) for r, f in rows if split is None or r["split"] == split]
            if not part:
                continue
            facts = sum(len(r["facts"]) for r, _ in part)
            share = sum(len(f) for _, f in part) / facts
            covered = sum(len(f) == len(r["facts"]) for r, f in part)
            label = split or "all"
            print(
                f"{name} {label}: {len(part)} questions, {facts} facts; facts found@{k} "
                f"{share:.2f}; questions with every fact found@{k} {covered}"
            )
            if split is None:
                summary.append(f"{name}_facts_found{k}={share:.3f} {name}_all_found{k}={covered}")
    print(" ".join(summary))


if __name__ == "__main__":
    main()
