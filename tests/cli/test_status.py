"""`selfrag --version`, `selfrag status` and the CLI's one logging setup (`-v`/`-q`, each
skipped record reported once)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import selfrag
from selfrag import cli
from selfrag.cli import main
from tests.suite import WIKI_PASSAGES


@pytest.fixture(autouse=True)
def _no_selfrag_environment(no_selfrag_environment: None) -> None:
    pass


def test_version_names_selfrag_llama_cpp_and_ray(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    first, second = capsys.readouterr().out.strip().splitlines()
    assert first == f"selfrag {selfrag.__version__}"
    assert second == f"llama-cpp-python {version('llama-cpp-python')}, ray {version('ray')}"


# --- logging ---------------------------------------------------------------------------------


def _logging_command(args) -> int:  # type: ignore[no-untyped-def]
    log = logging.getLogger("selfrag.jobs.example")
    log.debug("a debug record")
    log.info("an info record")
    log.warning("a warning record")
    return 0


@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        ([], {"info", "warning"}),
        (["-v"], {"debug", "info", "warning"}),
        (["--verbose"], {"debug", "info", "warning"}),
        (["-q"], {"warning"}),
        (["--quiet"], {"warning"}),
    ],
)
def test_one_logging_setup_with_verbose_and_quiet(
    flags, shown, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setitem(cli.COMMANDS, "config", _logging_command)
    logger = logging.getLogger("selfrag")
    handlers, level = list(logger.handlers), logger.level
    assert main([*flags, "config"]) == 0
    err = capsys.readouterr().err
    for kind in ("debug", "info", "warning"):
        assert err.count(f"{'an' if kind == 'info' else 'a'} {kind} record") == (kind in shown)
    assert "selfrag: WARNING" in err
    # Undone when the command ends: nothing left behind in a process that called main().
    assert logger.handlers == handlers and logger.level == level


def test_verbose_and_quiet_together_are_a_usage_error(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        main(["-v", "-q", "config"])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_each_skipped_record_is_reported_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    # Every record is bad: nothing to embed, so this needs no model.
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b'{"id": "d", "text": "caf\xe9"}\n{"id": "broken", "text": \n')
    home = tmp_path / "home"
    for flags in ([], ["-q"]):
        assert main([*flags, "--home", str(home), "index", "--no-progress", str(corpus)]) == 1
        captured = capsys.readouterr()
        assert captured.err.count(f"{corpus}:1: not UTF-8") == 1, captured.err
        assert captured.err.count(f"{corpus}:2: invalid JSON") == 1, captured.err
        # Logged once each, never printed again.
        assert captured.err.count("selfrag: WARNING: skipped ") == 2, captured.err
        assert "0 passages indexed, 2 skipped" in captured.out


# --- status ----------------------------------------------------------------------------------


def test_status_shows_index_model_heads_and_critique_without_loading_the_model(
    indexed_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    from selfrag.infra.engine import llama_engine

    def no_engine(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("selfrag status loaded the language model")

    monkeypatch.setattr(llama_engine.LlamaEngine, "__init__", no_engine)
    assert main(["--home", str(indexed_home), "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    index = status["index"]
    assert status["selfrag"] == selfrag.__version__
    assert status["home"] == str(indexed_home)
    assert index["passages"] > WIKI_PASSAGES  # the Normans paragraphs and the wiki records
    assert index["store"] == "embedded" and Path(index["where"]).is_relative_to(indexed_home)
    assert index["version"] not in ("", "empty")
    assert "minilm" in index["embedder"].lower() and index["embedding_model"] is None
    model = status["model"]
    assert model["backend"] == "llama_cpp" and model["path"].endswith(".gguf")
    assert "SmolLM2" in model["id"] and Path(model["path"]).name in model["id"]
    # The embedded default ships reflection heads, so `auto` resolves to the learned critique.
    assert status["heads"] is not None and Path(status["heads"]).is_file()
    assert status["critique"] == {"configured": "auto", "resolved": "learned", "usable": True}
    # Indexed with --no-calibrate: no threshold, said to be uncalibrated.
    assert status["support_threshold"] == {"min_support_score": 0.0, "calibrated": False}
    # What every engine process runs with: the threads and OpenMP's wait policy.
    assert model["threads"] == {
        "n_threads": 0,
        "threads": os.cpu_count(),
        "omp_wait_policy": "passive",
        "OMP_WAIT_POLICY": "PASSIVE",
    }

    assert main(["--home", str(indexed_home), "status"]) == 0
    text = capsys.readouterr().out
    assert f"passages       {index['passages']}" in text
    assert "critique       auto -> learned" in text
    assert "min_support    off (not calibrated: `selfrag calibrate`)" in text
    assert f"threads        {os.cpu_count()} (all cores)" in text
    assert "wait policy    passive (OMP_WAIT_POLICY=PASSIVE)" in text
    assert f"store          embedded {index['where']}" in text


def test_status_of_an_index_another_process_holds_is_a_clear_error(
    indexed_home: Path, capsys: pytest.CaptureFixture[str]
):
    """The embedded store belongs to one process: while another one has it open (as a running
    `selfrag serve` does), status says so and exits non-zero."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from selfrag.infra.settings_loader import load_settings\n"
            "from selfrag.runtime.system import LocalRuntime\n"
            f"rag = LocalRuntime(load_settings(overrides={{'home': {str(indexed_home)!r}}}))\n"
            "rag.store.count()\n"
            "print('open', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SELFRAG_")},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        code = main(["--home", str(indexed_home), "status"])
    finally:
        holder.communicate("", timeout=60)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"selfrag: the index in {indexed_home} is in use by another process")
    assert "Traceback" not in err and err.count("\n") == 1
