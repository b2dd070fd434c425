"""runtime/system.py: what a LocalRuntime loads, and in which order."""

from __future__ import annotations

from pathlib import Path

import pytest

import selfrag.infra.embeddings.embedder as embedder_module
import selfrag.infra.engine.cpu_builds.llama_cpu_builds as backend_module
from selfrag.pipeline.critics import PromptedCritic
from selfrag.pipeline.critics.verify import VerifiedCritic
from selfrag.runtime.system import LocalRuntime
from selfrag.schemas.settings import Settings
from tests.fakes import WordModel


def test_the_chat_model_chooses_the_cpu_backend_before_the_embedder_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process loads one backend, chosen by its first model: the embedder must not choose one
    # the chat model crashes on (an AMX build on a VM that reports AMX).
    order: list[str] = []
    monkeypatch.setattr(
        backend_module, "ensure_backend", lambda path, **_: order.append(f"backend {path.name}")
    )
    monkeypatch.setattr(
        embedder_module, "SentenceEmbedder", lambda name, **_: order.append("embedder") or object()
    )
    rag = LocalRuntime(Settings(home=tmp_path))
    rag.model.__dict__["path"] = tmp_path / "chat.gguf"
    assert rag.embedder is not None
    assert order == ["backend chat.gguf", "embedder"]


def test_the_verification_read_is_every_source_s_support_unless_configured_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = WordModel(specials=["<|im_start|>", "<|im_end|>"])
    for support_read, wrapped in (("verify", True), ("source", False)):
        settings = Settings(
            home=tmp_path, model={"support_read": support_read, "answerability": False}
        )
        rag = LocalRuntime(settings)
        rag.model.__dict__["engine"] = model
        critic = rag.critic("prompted")
        assert isinstance(critic, VerifiedCritic) is wrapped
        assert critic.name == "prompted"
        if wrapped:
            assert isinstance(critic.inner, PromptedCritic)
