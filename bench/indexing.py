"""Indexing throughput: one process against `selfrag index --ray` with Ray Data actors, side
by side in one run, each in a process of its own (so each peak RSS is its own).

The corpus is generated from the wiki sample (`wiki_sample_1000.jsonl`): its passages repeated
until there are `--passages` of them, each copy's text ending with its copy number, so every
passage is embedded (none is a duplicate id). Each mode indexes it into a fresh embedded store.
`ray` includes starting and stopping the private Ray instance; the peak RSS is the driver's
(the actors' own memory is not counted).

Last line: name=value.

    .venv/bin/python -m bench.indexing [--passages 10000] [--actors 2] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_corpus(source: Path, passages: int, out: Path) -> Path:
    """`passages` records from `source`, repeated with the copy number appended."""
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    with out.open("w", encoding="utf-8") as f:
        for n in range(passages):
            row = rows[n % len(rows)]
            copy = n // len(rows)
            text = row.get("text") or row.get("contents") or ""
            record = {"id": f"{row.get('id', n)}-{copy}", "text": f"{text} ({copy})"}
            f.write(json.dumps(record) + "\n")
    return out


def run_mode(mode: str, corpus: Path, actors: int) -> dict[str, float]:
    """Index `corpus` in this process (`one`) or with Ray (`ray`); seconds, passages, RSS."""
    from selfrag.infra.embeddings.embedder import SentenceEmbedder
    from selfrag.infra.store.qdrant_store import QdrantStore
    from selfrag.jobs.indexing import index_corpus
    from selfrag.jobs.ray_indexing import index_corpus_ray
    from selfrag.schemas.settings import RetrievalSettings

    settings = RetrievalSettings()
    with tempfile.TemporaryDirectory() as home:
        embedder = SentenceEmbedder()
        embedder.embed(["load"])  # the model's conversion and load are not indexing
        with QdrantStore.open(settings, Path(home), embedder) as store:
            started = time.perf_counter()
            if mode == "one":
                report = index_corpus(corpus, store, progress=False, retrieval=settings)
            else:
                report = index_corpus_ray(
                    corpus, store, retrieval=settings, actors=actors, progress=False
                )
            seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "passages": report.passages, "peak_mb": peak_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=10_000)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--mode", choices=("one", "ray"), help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # a child: one mode, its figures as JSON
        print(json.dumps(run_mode(args.mode, args.corpus, args.actors)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        corpus = make_corpus(
            args.data / "wiki_sample_1000.jsonl", args.passages, Path(tmp) / "corpus.jsonl"
        )
        rows = {}
        for mode in ("one", "ray"):
            child = ["--mode", mode, "--corpus", str(corpus), "--actors", str(args.actors)]
            done = subprocess.run(
                [sys.executable, "-m", "bench.indexing", *child],
                cwd=REPO,
                capture_output=True,
                text=True,
                check=True,
            )
            rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{'mode':<6} {'passages':>8} {'seconds':>8} {'passages/s':>10} {'peak MiB':>9}")
    for mode, r in rows.items():
        rate = r["passages"] / r["seconds"]
        print(
            f"{mode:<6} {r['passages']:>8} {r['seconds']:>8.1f} {rate:>10.1f} {r['peak_mb']:>9.0f}"
        )
    one, ray = rows["one"], rows["ray"]
    speedup = one["seconds"] / ray["seconds"]
    print(
        f"passages={one['passages']} actors={args.actors} one_s={one['seconds']:.1f} "
        f"ray_s={ray['seconds']:.1f} speedup={speedup:.2f} one_peak_mb={one['peak_mb']:.0f} "
        f"ray_peak_mb={ray['peak_mb']:.0f}"
    )


if __name__ == "__main__":
    main()
