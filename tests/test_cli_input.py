"""CLI behaviour on bad input: a clear message naming the problem and a non-zero exit."""

import json

import pytest

from infra.cli import build_parser, main


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFRAG_HOME", str(tmp_path / "home"))
    for name in list(__import__("os").environ):
        if name.startswith("SELFRAG_") and name != "SELFRAG_HOME":
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["ask", ""], "question"),
        (["ask", "   "], "question"),
        (["ask", "q", "--top-k", "0"], "top_k"),
        (["ask", "q", "--top-k", "51"], "top_k"),
        (["ask", "q", "--threshold", "1.5"], "threshold"),
        (["ask", "q", "--w-sup", "-1"], "w_sup"),
        (["ask", "q", "--beam", "0"], "beam"),
        (["ask", "x" * 2001], "question"),
    ],
)
def test_invalid_requests_name_the_field(argv, field, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "invalid request" in err and field in err


def test_unknown_choice_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ask", "q", "--mode", "sometimes"])
    assert exc.value.code == 2
    assert "--mode" in capsys.readouterr().err


def test_index_missing_path(tmp_path, capsys):
    assert main(["index", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_config_prints_effective_settings(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFRAG_DECODING__TOP_K", "5")
    assert main(["config", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["decoding"]["top_k"] == 5
    assert data["home"].endswith("home")


def test_bad_environment_is_reported(monkeypatch, capsys):
    monkeypatch.setenv("SELFRAG_DECODING__BEAM", "99")
    assert main(["config"]) == 2
    assert "decoding.beam" in capsys.readouterr().err


def test_every_decoding_dial_has_a_flag():
    help_text = build_parser()._subparsers._group_actions[0].choices["ask"].format_help()
    for flag in [
        "--mode",
        "--threshold",
        "--top-k",
        "--beam",
        "--max-segments",
        "--w-rel",
        "--w-sup",
        "--w-use",
        "--min-support",
        "--critique",
        "--min-relevance",
        "--require-relevant",
        "--on-unsupported",
        "--max-retrievals",
        "--max-prefill-tokens",
        "--timeout-s",
        "--length-normalize",
    ]:
        assert flag in help_text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "model file not found"),
        (b"hello, not a model", "not a GGUF file"),
        (b"GGUF\x03\x00\x00\x00" + b"\xff" * 40, "GGUF"),  # right magic, corrupt header
    ],
)
def test_serve_names_a_missing_or_corrupt_model_file_before_starting(
    tmp_path, monkeypatch, capsys, content, message
):
    model = tmp_path / "model.gguf"
    if content is not None:
        model.write_bytes(content)
    monkeypatch.setenv("SELFRAG_MODEL__PATH", str(model))
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and str(model) in err
    assert "Traceback" not in err
