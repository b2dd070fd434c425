"""runtime/model_artefacts.py: the model's file, identity, heads, answerability models, `auto`
and engine behind one object per backend, without loading a model."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from selfrag.infra.models.model_files import file_sha256
from selfrag.pipeline.critics import CritiqueUnavailable
from selfrag.pipeline.critics.verify import verified_support_id
from selfrag.pipeline.scoring import SUPPORT_THRESHOLD_SCORE
from selfrag.runtime.model_artefacts import (
    GGUFModel,
    VLLMServerModel,
    model_artefacts,
)
from selfrag.schemas.settings import Settings

VLLM = {"backend": "vllm", "vllm_url": "http://127.0.0.1:9", "vllm_model": "served/x"}


class Calibrated:
    """What `calibrated_filters` reads of `CalibratedDefaults`."""

    def filters(self, critique: str) -> dict[str, object]:
        return {"min_support_score": 0.5, "critique": critique}


def _gguf(tmp_path: Path, **model: Any) -> GGUFModel:
    tmp_path.mkdir(exist_ok=True)
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"weights")
    settings = Settings(home=tmp_path, model={"path": str(weights), **model})
    artefacts = model_artefacts(settings)
    assert isinstance(artefacts, GGUFModel)
    artefacts.__dict__["path"] = weights  # no preset to resolve: the file only needs a SHA-256
    return artefacts


def test_the_backend_is_chosen_once_from_the_settings(tmp_path: Path) -> None:
    assert isinstance(model_artefacts(Settings(home=tmp_path)), GGUFModel)
    assert isinstance(model_artefacts(Settings(home=tmp_path, model=VLLM)), VLLMServerModel)


def test_a_gguf_fingerprint_names_the_file_its_heads_and_the_verification_read(
    tmp_path: Path,
) -> None:
    heads = tmp_path / "heads.json"
    heads.write_text("{}")
    source = _gguf(tmp_path, heads=heads, support_read="source", answerability=False)
    sha = file_sha256(source.path)
    assert source.fingerprint == (
        f"m.gguf (m.gguf) sha256:{sha} heads:{file_sha256(heads)} {SUPPORT_THRESHOLD_SCORE}"
    )
    verify = _gguf(tmp_path / "v", support_read="verify")
    assert verify.heads_file is None  # none trained or shipped for these bytes
    assert verify.fingerprint.endswith(
        f"sha256:{sha} support:verify:{verified_support_id()} {SUPPORT_THRESHOLD_SCORE}"
    )
    assert "engine" not in source.__dict__  # the identity comes from files only


def test_learned_on_a_gguf_without_heads_is_refused_naming_the_file(tmp_path: Path) -> None:
    model = _gguf(tmp_path, answerability=False)
    model.__dict__["heads"] = None
    with pytest.raises(CritiqueUnavailable, match=r"model file m\.gguf.*selfrag train"):
        model.critique_heads("learned")
    assert model.critique_heads("auto") is None and model.critique_heads("prompted") is None
    assert model.calibrated_filters(Calibrated(), "learned")["critique"] == "learned"  # type: ignore[arg-type]


def test_a_vllm_server_model_has_no_files_and_its_critic_tells_auto(tmp_path: Path) -> None:
    model = model_artefacts(Settings(home=tmp_path, model={**VLLM, "answerability": True}))
    assert model.heads_file is None and model.heads is None
    assert model.answerability_file("learned") is None and model.answerability("learned") is None
    assert not model.reads_layers
    assert model.auto_critique() is None  # the runtime asks the critic instead
    assert model.critique_heads("learned") is None  # the critique factory refuses it
    assert model.calibrated_filters(Calibrated(), "learned") == {}  # type: ignore[arg-type]
    model.__dict__["engine"] = SimpleNamespace(model_id="served/x")
    assert model.fingerprint == "served/x"


def test_vllm_without_a_url_is_a_clear_error(tmp_path: Path) -> None:
    model = model_artefacts(Settings(home=tmp_path, model={"backend": "vllm"}))
    with pytest.raises(ValueError, match=r"needs model\.vllm_url"):
        _ = model.engine


def test_closing_closes_an_opened_engine_once(tmp_path: Path) -> None:
    closed: list[str] = []
    model = _gguf(tmp_path)
    model.close()  # nothing opened: nothing to close, nothing loaded
    model.__dict__["engine"] = SimpleNamespace(close=lambda: closed.append("engine"))
    model.close()
    model.close()
    assert closed == ["engine"]


def test_the_critiques_files_are_checked_without_an_engine_naming_a_bad_one(
    tmp_path: Path,
) -> None:
    """A heads file with one NaN weight served as ready while every answer failed in the
    branch pool: `check_critique` reads what a critic of the source reads, before any engine,
    so `selfrag serve` refuses to start on it."""
    import base64
    import json

    import numpy as np

    from selfrag.infra.models.heads_store import save_heads
    from selfrag.pipeline.heads import GROUP_LABELS, HeadsError

    heads = tmp_path / "heads.json"
    model = _gguf(tmp_path, heads=heads, answerability=False)
    rows = {g: np.ones((len(labels), 4), dtype=np.float32) for g, labels in GROUP_LABELS.items()}
    save_heads(heads, file_sha256(model.path), rows, {})
    model.check_critique("learned")  # well-formed: nothing to say
    doc = json.loads(heads.read_text())
    rows["support"][1, 2] = np.nan
    doc["groups"]["support"]["float32_base64"] = base64.b64encode(rows["support"]).decode()
    heads.write_text(json.dumps(doc))
    fresh = _gguf(tmp_path, heads=heads, answerability=False)
    fresh.check_critique("likelihood")  # reads no heads
    with pytest.raises(HeadsError, match="not finite") as err:
        fresh.check_critique("learned")
    assert str(heads) in str(err.value) and "selfrag train" in str(err.value)
