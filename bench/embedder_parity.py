"""Embedding parity: selfrag's llama.cpp embedder (the shipped all-MiniLM-L6-v2 converted to
GGUF, `infra.embeddings.embedder`) against sentence-transformers on the same folder, over the whole
sample corpus, side by side in one run.

Texts: every passage `selfrag index` writes for `squad_v2_small.json` and
`wiki_sample_1000.jsonl`, the answerable Normans questions (queries are embedded too), and 40
long texts (pairs of passages joined, most over the 256-piece limit, so both cut them). For
each llama.cpp weight format it reports how many texts tokenize to other word-piece ids than
sentence-transformers' tokenizer, and the cosine between the two vectors of each text (min,
1st percentile, mean), with both embedders' time (one thread each).

sentence-transformers (and torch) are not selfrag dependencies: install them beside it to run
this (`.venv/bin/python -m pip install sentence-transformers`). Last line: name=value.

    .venv/bin/python -m bench.embedder_parity [--data ../shared/data] [--formats f32,f16]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from selfrag.infra.embeddings.embedder import SentenceEmbedder, default_model_dir
from selfrag.jobs.indexing import corpus_passages

TUNING_ARTICLE = "Normans"


def corpus_texts(data: Path) -> dict[str, list[str]]:
    """The texts to compare, by kind."""
    import json

    passages = [
        p.text
        for name in ("squad_v2_small.json", "wiki_sample_1000.jsonl")
        for p in corpus_passages(data / name)
    ]
    squad = json.loads((data / "squad_v2_small.json").read_text(encoding="utf-8"))
    questions = [
        qa["question"]
        for article in squad["data"]
        if article["title"] == TUNING_ARTICLE  # the other article is held out
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    ]
    long = [passages[i] + " " + passages[i + 1] for i in range(0, 80, 2)]
    return {"passages": passages, "questions": questions, "long": long}


def reference(texts: list[str]) -> tuple[np.ndarray, list[list[int]], float]:
    """sentence-transformers' vectors and word-piece ids of `texts`, and its embedding time."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    model = SentenceTransformer(str(default_model_dir()), device="cpu", local_files_only=True)
    ids = [model.tokenize([t])["input_ids"][0].tolist() for t in texts]
    started = time.perf_counter()
    vectors = model.encode(texts, batch_size=32, normalize_embeddings=True)
    return np.asarray(vectors, dtype=np.float32), ids, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_data = Path(__file__).resolve().parents[2] / "shared" / "data"
    parser.add_argument("--data", type=Path, default=default_data)
    parser.add_argument("--formats", default="f32,f16")
    args = parser.parse_args()
    kinds = corpus_texts(args.data)
    texts = [t for group in kinds.values() for t in group]
    kind_of = np.array([k for k, group in kinds.items() for _ in group])
    expected, expected_ids, st_s = reference(texts)
    print(f"texts: {', '.join(f'{len(v)} {k}' for k, v in kinds.items())}")
    print(f"sentence-transformers: {st_s:.1f} s ({len(texts) / st_s:.1f} texts/s, 1 thread)")
    long_cut = sum(1 for i, k in enumerate(kind_of) if k == "long" and len(expected_ids[i]) == 256)
    print(
        f"long texts cut at 256 pieces by sentence-transformers: {long_cut} of {len(kinds['long'])}"
    )
    figures: dict[str, Any] = {"texts": len(texts), "st_s": f"{st_s:.1f}"}
    for fmt in args.formats.split(","):
        embedder = SentenceEmbedder(fmt=fmt)  # type: ignore[arg-type]
        started = time.perf_counter()
        embedder.embed(["load"])
        load_s = time.perf_counter() - started
        ids = [embedder.tokenize(t) for t in texts]
        differ = [i for i, (a, b) in enumerate(zip(ids, expected_ids, strict=True)) if a != b]
        started = time.perf_counter()
        vectors = embedder.embed(texts)
        llama_s = time.perf_counter() - started
        cos = np.sum(vectors * expected, axis=1)
        print(
            f"\nllama.cpp {fmt}: load+convert {load_s:.1f} s, {llama_s:.1f} s "
            f"({len(texts) / llama_s:.1f} texts/s, 1 thread), "
            f"{len(differ)} texts with other word-piece ids"
        )
        for i in differ[:3]:
            print(f"  ids differ: {texts[i][:80]!r}")
        print(f"{'texts':<10} {'n':>5} {'min cos':>9} {'p01 cos':>9} {'mean cos':>9}")
        for kind in (*kinds, "all"):
            c = cos if kind == "all" else cos[kind_of == kind]
            print(
                f"{kind:<10} {len(c):>5} {c.min():>9.6f} {np.percentile(c, 1):>9.6f} "
                f"{c.mean():>9.6f}"
            )
        figures |= {
            f"{fmt}_min_cos": f"{cos.min():.6f}",
            f"{fmt}_mean_cos": f"{cos.mean():.6f}",
            f"{fmt}_ids_differ": len(differ),
            f"{fmt}_s": f"{llama_s:.1f}",
            f"{fmt}_over_st": f"{llama_s / st_s:.2f}",
        }
        embedder.close()
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
