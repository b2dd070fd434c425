"""The llama.cpp embedder (`infra.embeddings.embedder`, the shipped all-MiniLM-L6-v2 converted to
GGUF by
`infra.embeddings.bert_gguf`): conversion once, truncation, and an index built by the
sentence-transformers embedder it replaces, reused or refused."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import selfrag.infra.embeddings.embedder as embedder_module
from selfrag.infra.embeddings.bert_gguf import BERT_FORMATS, BertFolder, read_safetensors
from selfrag.infra.embeddings.embedder import SentenceEmbedder, default_model_dir
from selfrag.infra.embeddings.wordpiece import WordPiece
from selfrag.infra.engine.cpu_builds.cpu_variants import VARIANT_FEATURES
from selfrag.infra.models.model_files import (
    FTYPE_ALL_F32,
    FTYPE_MOSTLY_BF16,
    FTYPE_MOSTLY_F16,
    ModelFileError,
    read_gguf_metadata,
)
from selfrag.infra.store.qdrant_store import QdrantStore, StoreMisconfigured
from selfrag.pipeline.protocols import Passage
from selfrag.schemas.settings import RetrievalSettings
from tests.real import real

PASSAGES = [
    Passage("rollo#0", "Rollo was the first ruler of Normandy.", "Rollo", metadata={"doc_id": "r"}),
    Passage("lava#0", "Lava escapes from a magma chamber.", "Volcano", metadata={"doc_id": "v"}),
    Passage("bread#0", "Sourdough rises with wild yeast.", "Bread", metadata={"doc_id": "b"}),
]


@pytest.fixture(scope="module")
@real
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder()


def sentence_transformers_id(embedder: SentenceEmbedder) -> str:
    [found] = [i for i in embedder.replaces if "-llama-" not in i]
    return found


class OldEmbedder:
    """Stands for the sentence-transformers embedder an index was built with: its model id,
    and vectors that are the real ones (`noise` 0) or not."""

    def __init__(self, inner: SentenceEmbedder, noise: float) -> None:
        self.model_id = sentence_transformers_id(inner)
        self.dim = inner.dim
        self._inner = inner
        self._noise = noise

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        vectors = self._inner.embed(texts)
        if self._noise:
            rng = np.random.default_rng(0)
            vectors = vectors + self._noise * rng.standard_normal(vectors.shape)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors.astype(np.float32)


def test_the_model_is_converted_once_into_the_cache(llama_model: Path, tmp_path: Path) -> None:
    first = SentenceEmbedder(cache_dir=tmp_path)
    path = first.gguf_path()
    assert path.parent == tmp_path and path.name.endswith(f".{first.fmt}.gguf")
    assert read_gguf_metadata(path, "general.architecture") == "bert"
    assert read_gguf_metadata(path, "bert.pooling_type") == 1  # mean, as the folder says
    made = path.stat().st_mtime_ns
    second = SentenceEmbedder(cache_dir=tmp_path)
    assert second.gguf_path() == path and path.stat().st_mtime_ns == made
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [path.name]
    vectors = second.embed(["a volcano erupts", "bread rises"])
    assert vectors.shape == (2, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert second.model_id.endswith(f"-llama-{first.fmt}") and second.replaces == first.replaces


def test_auto_converts_to_bf16_only_for_a_backend_that_multiplies_it_natively(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variant, fmt in [("zen4", "bf16"), ("icelake", "f16"), ("haswell", "f16"), ("x64", "f16")]:
        monkeypatch.setattr(
            embedder_module, "expected_features", lambda v=variant: VARIANT_FEATURES[v]
        )
        chosen = SentenceEmbedder()  # nothing converted or loaded
        assert (chosen.fmt, chosen.model_id.endswith(f"-llama-{fmt}")) == (fmt, True)
        others = {f"{chosen.model_id.rsplit('-', 1)[0]}-{f}" for f in BERT_FORMATS if f != fmt}
        assert chosen.replaces == {sentence_transformers_id(chosen), *others}
    assert SentenceEmbedder(fmt="f32").fmt == "f32"
    with pytest.raises(ValueError, match="fmt must be auto or one of f32, f16, bf16, got 'q8_0'"):
        SentenceEmbedder(fmt="q8_0")  # type: ignore[arg-type]


def test_each_format_converts_with_its_file_type_and_embeds_as_f32_does(
    llama_model: Path, tmp_path: Path
) -> None:
    texts = [p.text for p in PASSAGES] + ["Who ruled Normandy first?", "a volcano erupts"]
    ftypes = {"f32": FTYPE_ALL_F32, "f16": FTYPE_MOSTLY_F16, "bf16": FTYPE_MOSTLY_BF16}
    vectors = {}
    for fmt in BERT_FORMATS:
        embedder = SentenceEmbedder(fmt=fmt, cache_dir=tmp_path)
        assert read_gguf_metadata(embedder.gguf_path(), "general.file_type") == ftypes[fmt]
        vectors[fmt] = embedder.embed(texts)
        embedder.close()
    for fmt in ("f16", "bf16"):
        cosine = np.sum(vectors[fmt] * vectors["f32"], axis=1)
        assert cosine.min() >= 0.9999, (fmt, cosine.min())
    assert not np.array_equal(vectors["bf16"], vectors["f16"])  # three files, not one


def test_an_index_built_in_another_format_is_reused_after_a_sample_check(
    tmp_path: Path, embedder: SentenceEmbedder, caplog: pytest.LogCaptureFixture
) -> None:
    other = SentenceEmbedder(fmt="f16" if embedder.fmt != "f16" else "bf16")
    with QdrantStore.open(RetrievalSettings(), tmp_path, other) as store:
        store.upsert(PASSAGES)
    with caplog.at_level("WARNING", logger="selfrag.store"):
        store = QdrantStore.open(RetrievalSettings(), tmp_path, embedder)
    with store:
        assert f"indexed with {other.model_id}" in caplog.text and "reused" in caplog.text
        assert store.search("Who ruled Normandy first?", 1)[0].id == "rollo#0"
    other.close()


def test_long_texts_are_cut_at_256_word_pieces_like_sentence_transformers(
    embedder: SentenceEmbedder,
) -> None:
    long = " ".join(f"Normandy{i}" for i in range(400))
    ids = embedder.tokenize(long)
    assert len(ids) == embedder.max_seq_length == 256
    assert (ids[0], ids[-1]) == (101, 102)  # [CLS] ... [SEP]
    longer = long + " and a tail that is never read"
    assert np.allclose(embedder.embed([long]), embedder.embed([longer]), atol=1e-6)
    assert embedder.tokenize("Who founded Normandy?") == [101, 2040, 2631, 13298, 1029, 102]


def test_accents_are_stripped_as_hugging_face_bert_does(embedder: SentenceEmbedder) -> None:
    # "Caen" and "Caén" are one word to an uncased BERT tokenizer; without stripping, llama.cpp
    # would see a combining accent and answer [UNK] (id 100).
    assert embedder.tokenize("Caén, Bayeux, Rouen") == embedder.tokenize("Caen, Bayeux, Rouen")
    assert 100 not in embedder.tokenize("Émile Zola était né à Paris")


def test_spacing_vowel_signs_stay_word_pieces_as_in_hugging_face(
    embedder: SentenceEmbedder,
) -> None:
    # llama.cpp's own BERT tokenizer drops the Devanagari vowel sign "ा" (Unicode Mc);
    # Hugging Face keeps it as the piece "##ा", and the model was trained on those ids.
    vocab = BertFolder.read(default_model_dir()).vocabulary()
    ids = embedder.tokenize("हवा")
    assert [vocab[i] for i in ids] == ["[CLS]", "ह", "##व", "##ा", "[SEP]"]
    assert embedder.tokenize("a [SEP] b") == [101, 1037, 102, 1038, 102]
    assert embedder.tokenize("a\x0bb\tc") == [101, 11113, 1039, 102]  # VT dropped, tab a space


def test_a_long_text_is_read_in_chunks_that_tokenize_as_the_whole() -> None:
    folder = BertFolder.read(default_model_dir())
    special = folder.special_tokens()
    wordpiece = WordPiece(
        folder.vocabulary(),
        lowercase=True,
        strip_accents=True,
        specials=list(special.values()),
        unk=special["unk"],
    )
    # Controls that are not word breaks, special tokens and marks around the chunk cuts.
    text = "Rollo's naïve a\x0bb [SEP] हवा x\x0cy 中文 $5 e\u0301\t" * 400
    glued = "ab\x0bcd," * 3000  # a vertical tab joins "ab" and "cd": no place to cut
    for long in (text, glued):
        whole = wordpiece.ids(long)
        assert len(whole) > 5000
        for limit in (254, 1000, 5000):
            assert wordpiece.ids(long, limit) == whole[:limit]


def test_texts_in_one_call_embed_as_they_do_alone(embedder: SentenceEmbedder) -> None:
    texts = [f"passage {i} about " + "Normans " * (i * 7) for i in range(40)]
    together = embedder.embed(texts)  # several llama.cpp batches of several sequences
    alone = np.vstack([embedder.embed([t]) for t in texts[::13]])
    # Not bit-equal (llama.cpp's kernels split a batch of other shapes differently), but no
    # sequence sees another: a leak would move these far more.
    assert np.min(np.sum(together[::13] * alone, axis=1)) > 0.99999


def test_ids_embed_on_more_threads_as_their_texts_do_on_one(embedder: SentenceEmbedder) -> None:
    texts = ["Rollo founded Normandy.", "The Normans spoke Norman French."]
    alone = embedder.embed(texts)  # the embedder's one thread
    on_two = embedder.embed_tokens([embedder.tokenize(t) for t in texts], threads=2)
    assert np.allclose(alone, on_two, atol=1e-5)
    assert np.allclose(embedder.embed(texts), alone, atol=1e-5)  # back on one thread
    with pytest.raises(ValueError, match="threads"):
        embedder.embed_tokens([embedder.tokenize(texts[0])], threads=0)


def test_a_folder_that_is_not_bert_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(default_model_dir(), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}))
    with pytest.raises(ModelFileError, match="model_type 'roberta'; only BERT"):
        SentenceEmbedder(folder, cache_dir=tmp_path / "cache")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelFileError, match=r"lacks the BERT sizes \['hidden_size'"):
        SentenceEmbedder(folder, cache_dir=tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="not a sentence-transformers model folder"):
        SentenceEmbedder(tmp_path / "nothing")


def test_safetensors_are_read_without_torch() -> None:
    folder = BertFolder.read(default_model_dir())
    tensors = read_safetensors(folder.weights)
    assert tensors["embeddings.word_embeddings.weight"].shape == (30522, 384)
    assert tensors["embeddings.word_embeddings.weight"].dtype == np.float32
    assert (folder.pooling, folder.max_seq_length, folder.strip_accents) == (1, 256, True)


def test_an_index_of_the_replaced_embedder_with_the_same_vectors_is_reused(
    tmp_path: Path, embedder: SentenceEmbedder, caplog: pytest.LogCaptureFixture
) -> None:
    old = OldEmbedder(embedder, noise=0.0)
    with QdrantStore.open(RetrievalSettings(), tmp_path, old) as store:
        store.upsert(PASSAGES)
        version = store.index_version()
    with caplog.at_level("WARNING", logger="selfrag.store"):
        store = QdrantStore.open(RetrievalSettings(), tmp_path, embedder)
    with store:
        assert "reused, and recorded as indexed with" in caplog.text
        assert store.search("Who ruled Normandy first?", 1)[0].id == "rollo#0"
        assert store.index_version() == version  # the vectors did not change
    facts = json.loads((tmp_path / "edge" / "passages" / "index.json").read_text())
    assert facts["embedding_model"] == embedder.model_id
    # Recorded: the next open checks nothing, and the old embedder is now the stranger.
    with pytest.raises(StoreMisconfigured, match=f"indexed with {re.escape(embedder.model_id)}"):
        QdrantStore.open(RetrievalSettings(), tmp_path, old)


def test_an_index_of_the_replaced_embedder_with_other_vectors_is_refused(
    tmp_path: Path, embedder: SentenceEmbedder
) -> None:
    with QdrantStore.open(RetrievalSettings(), tmp_path, OldEmbedder(embedder, 0.2)) as store:
        store.upsert(PASSAGES)
    with pytest.raises(StoreMisconfigured) as refused:
        QdrantStore.open(RetrievalSettings(), tmp_path, embedder)
    message = str(refused.value)
    assert "does not reproduce" in message and "selfrag --home NEW_HOME index" in message
    facts = json.loads((tmp_path / "edge" / "passages" / "index.json").read_text())
    assert facts["embedding_model"] in embedder.replaces  # left as it was


def test_a_local_mode_index_of_the_replaced_embedder_is_migrated_then_reused(
    tmp_path: Path, embedder: SentenceEmbedder, caplog: pytest.LogCaptureFixture
) -> None:
    """The earlier store format (qdrant-client's local mode) written by the
    sentence-transformers embedder: its vectors are copied, then checked like any other."""
    from qdrant_client import QdrantClient, models

    from selfrag.infra.store.qdrant_store import point_id

    old_id = sentence_transformers_id(embedder)
    client = QdrantClient(path=str(tmp_path / "qdrant"))
    client.create_collection(
        "passages",
        vectors_config={"dense": models.VectorParams(size=384, distance=models.Distance.COSINE)},
        sparse_vectors_config={"sparse": models.SparseVectorParams(modifier=models.Modifier.IDF)},
        metadata={"index_version": "v-old", "embedding_model": old_id},
    )
    vectors = embedder.embed([p.text for p in PASSAGES])
    client.upsert(
        "passages",
        points=[
            models.PointStruct(
                id=point_id(p.id),
                vector={"dense": v.tolist()},
                payload={"passage_id": p.id, "title": p.title, "text": p.text, "doc_id": p.id},
            )
            for p, v in zip(PASSAGES, vectors, strict=True)
        ],
    )
    client.close()
    with caplog.at_level("WARNING", logger="selfrag.store"):
        store = QdrantStore.open(RetrievalSettings(), tmp_path, embedder)
    with store:
        assert store.count() == 3
        assert store.search("Who ruled Normandy first?", 1)[0].id == "rollo#0"
    assert "migrated 3 passages" in caplog.text and "reused, and recorded" in caplog.text
    facts = json.loads((tmp_path / "edge" / "passages" / "index.json").read_text())
    assert facts["embedding_model"] == embedder.model_id


def _safetensors(path: Path, header: object, data: bytes = b"\0" * 16, length: int | None = None):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    size = len(raw) if length is None else length
    path.write_bytes(size.to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "length", "why"),
    [
        ({}, 2**63, "a header of 9223372036854775808 bytes"),
        ({}, 2**64 - 1, "a header of"),
        (["not", "an", "object"], None, "the header is not an object"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, None, "does not fit"),
        ({"w": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, None, "does not fit"),
        ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, None, "shape of"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": "0-16"}}, None, "data_offsets"),
        ({"w": {"dtype": "F32", "shape": [4]}}, None, "data_offsets"),
        ({"w": {"shape": [4], "data_offsets": [0, 16]}}, None, "unsupported dtype"),
        ({"w": [1, 2]}, None, "described by list"),
        (b"[" * 50_000 + b"]" * 50_000, None, "nested"),
        (b"\xff\xfe{}", None, "unreadable safetensors"),
    ],
)
def test_a_malformed_safetensors_header_is_an_error_naming_the_file(
    tmp_path: Path, header: object, length: int | None, why: str
) -> None:
    """They raised OverflowError, AttributeError or a numpy message naming no file."""
    path = _safetensors(tmp_path / "model.safetensors", header, length=length)
    with pytest.raises(ModelFileError, match=why) as err:
        read_safetensors(path)
    assert str(path) in str(err.value)


def test_a_well_formed_small_safetensors_file_reads(tmp_path: Path) -> None:
    values = np.arange(4, dtype=np.float32)
    header = {
        "__metadata__": {"format": "pt"},
        "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
    }
    path = _safetensors(tmp_path / "model.safetensors", header, values.tobytes())
    assert read_safetensors(path)["w"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
