"""The llama.cpp embedder against sentence-transformers on the same folder: the same word-piece
ids and vectors within cosine 0.999, on a sample of the corpus and on texts chosen to differ
(accents, Indic vowel signs, symbols, CJK, control characters, special tokens, long texts).

sentence-transformers is not a dependency (it brings torch): this runs only where it is
installed. The same comparison over the whole corpus is in docs/indexing.md."""

from __future__ import annotations

import os

import numpy as np
import pytest

from selfrag.infra.embeddings.embedder import SentenceEmbedder, default_model_dir
from selfrag.jobs.indexing import corpus_passages
from tests.paths import ROOT
from tests.real import real

pytest.importorskip(
    "sentence_transformers", reason="sentence-transformers is not installed", exc_type=ImportError
)
DATA = ROOT.parent / "shared" / "data"
HARD = [
    "Who was the Norse leader who founded Normandy?",
    "Caén, Bayeux and Rouen; Æthelred's naïve façade in Zürich—Genève…«quote»",
    "Bhakarkhadi (Marathi: 'भाकरखाडी ७ किमी'), Hava Ahe Tari Kashi (हवा आहे तरी कशी)",
    "$5 + 3 = 8 <tag> a|b ~x ^y `z` 中文字 テスト 한국어 🙂x",
    "a\x0bb c\x0cd e\x1ff naïve\u200bword \u2028 line\u00a0nbsp İstanbul ǅ ß ﬁ Ⅻ ①",
    "[SEP] [cls] x[MASK]y " + "x" * 150,
    " ".join(f"Normandy{i} was ruled by Rollo" for i in range(120)),  # far past 256 pieces
]


@pytest.fixture(scope="module")
@real
def reference():
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    return SentenceTransformer(str(default_model_dir()), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    if not (DATA / "wiki_sample_1000.jsonl").is_file():
        return HARD
    passages = [p.text for p in corpus_passages(DATA / "wiki_sample_1000.jsonl")]
    return HARD + passages[::25]  # 40 Wikipedia passages


def test_the_same_word_piece_ids_as_sentence_transformers(reference, texts) -> None:
    embedder = SentenceEmbedder()
    for text in texts:
        expected = reference.tokenizer(text, truncation=True, max_length=256)["input_ids"]
        assert embedder.tokenize(text) == expected, text[:80]


def test_the_same_vectors_as_sentence_transformers(reference, texts) -> None:
    expected = reference.encode(texts, batch_size=16, normalize_embeddings=True)
    for fmt in ("f32", "f16", "bf16"):
        vectors = SentenceEmbedder(fmt=fmt).embed(texts)
        cosine = np.sum(vectors * expected, axis=1)
        assert cosine.min() >= 0.999, (fmt, texts[int(cosine.argmin())][:80], cosine.min())
