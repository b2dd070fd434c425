"""The CLI end to end with the real model and store (one process per command, like a user)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfrag.cli import main
from selfrag.infra.settings_loader import load_settings
from selfrag.runtime.system import LocalRuntime
from tests.suite import SUITE_ENV


def test_cli_ask_json(indexed_home: Path, capsys: pytest.CaptureFixture[str]):
    code = main(
        [
            "--home",
            str(indexed_home),
            "ask",
            "In what country is Normandy located?",
            "--json",
            "--mode",
            "always",
            "--top-k",
            "2",
            "--max-segments",
            "1",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["answer"].strip()
    assert data["config"]["top_k"] == 2
    assert set(data["usage"]) >= {"prefill_tokens", "branches_opened", "retrievals"}


def test_cli_ask_table(indexed_home: Path, capsys: pytest.CaptureFixture[str]):
    code = main(
        [
            "--home",
            str(indexed_home),
            "ask",
            "When did the Normans conquer England?",
            "--min-support-score",
            "0",
            "--mode",
            "always",
            "--top-k",
            "2",
            "--max-segments",
            "1",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "s_sup" in out and "IsSup" in out and "critique=learned" in out


def test_the_readme_example_is_right_or_abstains_or_shows_low_support(
    indexed_home: Path, capsys: pytest.CaptureFixture[str]
):
    """The first answer a new user sees is not a confident invention."""
    from selfrag.pipeline.decoder import ABSTAIN_MESSAGE

    question = "Who was the Norse leader who founded Normandy?"
    assert main(["--home", str(indexed_home), "ask", question]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert "Rollo" in first or ABSTAIN_MESSAGE in out or "Low support" in out, out


def test_reindexing_does_not_duplicate(indexed_home: Path, normans_squad: Path):
    settings = load_settings(environ={"SELFRAG_HOME": str(indexed_home), **SUITE_ENV})
    with LocalRuntime(settings) as system:
        before = system.store.count()
    index = ["--home", str(indexed_home), "index", "--no-progress", "--no-calibrate"]
    assert main([*index, str(normans_squad)]) == 0
    with LocalRuntime(settings) as system:
        assert system.store.count() == before
