"""cli/train.py: `selfrag train --critic`, its refusals and a real run whose manifest names the
critic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfrag.cli import main
from selfrag.infra.models.critic_label_cache import CriticLabelFile
from selfrag.infra.models.heads_store import read_manifest
from tests.suite import TrainedHeads


def test_a_critic_that_is_neither_a_preset_nor_a_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    missing = tmp_path / "nope.gguf"
    code = main(["--home", str(tmp_path), "train", "--critic", str(missing), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--critic {missing}: neither a model preset" in err


def test_a_critic_file_that_is_not_gguf_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    code = main(["--home", str(tmp_path), "train", "--critic", str(bad), "--no-progress"])
    assert code == 2
    assert f"--critic {bad}: not a GGUF file" in capsys.readouterr().err


def test_critic_with_reuse_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    args = ["--home", str(tmp_path), "train", "--reuse", "--export-gguf", str(tmp_path / "o.gguf")]
    assert main([*args, "--critic", "smollm2"]) == 2
    assert "--reuse only applies" in capsys.readouterr().err


def test_train_with_a_critic_records_it_and_caches_its_reads(trained_heads: TrainedHeads):
    # The session's one training run (tests/conftest.py): the served model as its own critic.
    assert "support labelled by" in trained_heads.printed
    critic = read_manifest(trained_heads.path)["critic"]
    assert critic["model"].lower().startswith("smollm2") and critic["mode"] == "add"
    assert critic["labelled"] > 0 and critic["read"] == critic["labelled"]
    assert critic["relabelled_constructed"] == 0
    (cache,) = (trained_heads.home / "critic_labels").iterdir()
    assert len(CriticLabelFile(cache)) == critic["labelled"]
    assert json.loads(cache.read_text().splitlines()[0])["key"]
