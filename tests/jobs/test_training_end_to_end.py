"""`selfrag train` with the real model and index: heads trained once per session (the
`trained_heads` fixture), then used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfrag.cli import main
from selfrag.infra.models.heads_store import load_heads, read_manifest
from selfrag.infra.models.model_files import file_sha256
from selfrag.infra.settings_loader import load_settings
from selfrag.pipeline.heads import GROUP_LABELS
from selfrag.runtime.system import LocalRuntime
from tests.suite import TrainedHeads


def test_train_small_corpus_then_answer_with_the_heads(
    trained_heads: TrainedHeads,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The session's one training run (tests/conftest.py): 12 passages, seed 3, on the index.
    home, out = trained_heads.home, trained_heads.path
    printed = trained_heads.printed
    assert "validation AUC" in printed and " at L2 " in printed and str(out) in printed
    heads = load_heads(out)
    manifest = read_manifest(out)
    assert set(manifest["groups"]) == set(GROUP_LABELS)
    assert manifest["seed"] == 3 and manifest["data"]["qa_questions"] == 0
    assert all(g["examples"] >= 20 for g in manifest["groups"].values())
    with LocalRuntime(load_settings(overrides={"home": str(home)})) as rag:
        assert heads.model_sha256 == file_sha256(rag.model.path)

    monkeypatch.setenv("SELFRAG_MODEL__HEADS", str(out))
    ask = ["--home", str(home), "ask", "Who founded Normandy?", "--json"]
    assert main([*ask, "--critique", "learned", "--max-segments", "1", "--mode", "always"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["critique"] == "learned" and answer["answer"].strip()
    grounded = [s for s in answer["segments"] if s["citation"] is not None]
    assert all(s["s_rel"] is not None and s["s_sup"] is not None for s in grounded)


def test_train_refuses_a_corpus_too_small_for_a_group(
    llama_model: Path, tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "tiny.jsonl"
    lines = [json.loads(x) for x in (shared_data / "wiki_sample_1000.jsonl").open()][:12]
    corpus.write_text("".join(json.dumps(x) + "\n" for x in lines))
    home = tmp_path / "home"
    assert main(["--home", str(home), "index", "--no-progress", "--no-calibrate", str(corpus)]) == 0
    code = main(["--home", str(home), "train", "--passages", "12", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "too small to train the" in err and "examples" in err


def test_ask_refuses_heads_of_another_model_file(
    indexed_home: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import numpy as np

    from selfrag.infra.models.heads_store import save_heads

    other = "ab" * 32
    weights = {g: np.zeros((len(labels), 576)) for g, labels in GROUP_LABELS.items()}
    path = tmp_path / "other.json"
    save_heads(path, other, weights, {})
    monkeypatch.setenv("SELFRAG_MODEL__HEADS", str(path))
    code = main(["--home", str(indexed_home), "ask", "Who founded Normandy?", "--mode", "never"])
    assert code == 2
    err = capsys.readouterr().err
    with LocalRuntime(load_settings(overrides={"home": str(indexed_home)})) as rag:
        mine = file_sha256(rag.model.path)
    assert other in err and mine in err
