"""runtime/passage_service.py: the passage service opens a store (and the embedder it needs)
and nothing else of the runtime. Real embedded Qdrant, a hashing embedder."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import selfrag.infra.embeddings.embedder as embedder_module
import selfrag.infra.engine.cpu_builds.llama_cpu_builds as builds_module
import selfrag.runtime.system as system_module
from selfrag.pipeline.protocols import Passage
from selfrag.runtime.model_artefacts import GGUFModel
from selfrag.runtime.passage_service import PassageService
from selfrag.schemas.settings import Settings

PASSAGES = [
    Passage("rollo#0", "Rollo was the first ruler of Normandy.", "Rollo", metadata={"doc_id": "r"}),
    Passage("lava#0", "Lava escapes from a magma chamber.", "Volcano", metadata={"doc_id": "v"}),
]


class HashEmbedder:
    """Deterministic unit vectors: a store to search without a model to load."""

    dim = 8
    model_id = "hash-embedder"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        rows = []
        for text in texts:
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
            row = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
            rows.append(row / np.linalg.norm(row))
        return np.array(rows, dtype=np.float32).reshape(len(texts), self.dim)


def test_the_service_opens_a_store_after_the_chat_model_chose_the_cpu_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []

    def no_runtime(*_: object, **__: object) -> None:
        raise AssertionError("a passage service builds no LocalRuntime")

    monkeypatch.setattr(system_module.LocalRuntime, "__init__", no_runtime)
    monkeypatch.setattr(GGUFModel, "path", tmp_path / "chat.gguf")  # no preset to resolve
    monkeypatch.setattr(
        builds_module, "ensure_backend", lambda path, **_: order.append(f"backend {path.name}")
    )
    monkeypatch.setattr(
        embedder_module,
        "SentenceEmbedder",
        lambda name, **_: order.append("embedder") or HashEmbedder(),
    )
    service = PassageService(Settings(home=tmp_path / "home"))
    try:
        # Opened at start (an empty index: not ready), the CPU build chosen as the runtime does.
        assert order == ["backend chat.gguf", "embedder"]
        assert service.ready() is False
        service._open().upsert(PASSAGES)
        assert service.ready() is True and service.count() == 2
        assert service.search("Rollo was the first ruler of Normandy.", 1)[0].id == "rollo#0"
    finally:
        service.close()
    # Closed, the embedded store's folder is free for the next owner.
    again = PassageService(Settings(home=tmp_path / "home"))
    try:
        assert again.count() == 2
    finally:
        again.close()
    assert order.count("embedder") == 2  # one per service, none per open
