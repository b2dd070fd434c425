"""CLI behaviour on bad input: a clear message naming the problem and a non-zero exit."""

import json

import pytest

from selfrag.cli import main
from selfrag.cli.parser import build_parser


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch, no_selfrag_environment):
    monkeypatch.setenv("SELFRAG_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["ask", ""], "question"),
        (["ask", "   "], "question"),
        (["ask", "\u200b\u200d\x07\x1b\u2060\ufeff"], "question"),
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


def test_a_threshold_per_corpus_out_of_bounds_names_the_field(capsys):
    assert main(["ask", "q", "--min-support-score-by-corpus", "a.json=2"]) == 2
    assert "min_support_score_by_corpus" in capsys.readouterr().err


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


def _offline_batch(tmp_path):
    """A batch input that needs no model: a Latin-1 line, a bad config, one good-looking row
    whose config is invalid too."""
    src = tmp_path / "q.jsonl"
    src.write_bytes(
        b'{"id": "a", "question": "Who?", "config": {"top_k": 0}}\n'
        b'{"id": "latin", "question": "caf\xe9?"}\n'
        b'{"question": "Where?", "config": {"beam": 0}}\n'
    )
    return src, tmp_path / "answers.jsonl"


def test_batch_turns_a_non_utf8_line_into_one_error_record(tmp_path, capsys):
    src, out = _offline_batch(tmp_path)
    # Every row got a record (errors too): exit 0, the error records listed.
    assert main(["batch", str(src), "--out", str(out), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count(f"{src}:2: not UTF-8") == 1  # reported once, logged
    assert "Traceback" not in captured.err
    assert "failed=2 skipped=0 retried=0 malformed=1" in captured.out
    assert "error record a (invalid): " in captured.err
    assert "error record latin (malformed): " in captured.err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["status"], r["error"]["type"]) for r in records] == [
        ("latin", "error", "malformed"),
        ("a", "error", "invalid"),
        ("3", "error", "invalid"),
    ]
    # A rerun skips every id; --retry-failed answers the three error ids again.
    assert main(["batch", str(src), "--out", str(out), "--no-progress"]) == 0
    assert "skipped=3 retried=0" in capsys.readouterr().out
    assert main(["batch", str(src), "--out", str(out), "--no-progress", "--retry-failed"]) == 0
    assert "skipped=0 retried=3" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 3  # still one record per id


def test_batch_refuses_an_output_another_run_holds(tmp_path, capsys):
    from selfrag.jobs.batch.batch_records import lock_output

    src, out = _offline_batch(tmp_path)
    with lock_output(out):
        assert main(["batch", str(src), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{out} is being written by another `selfrag batch` run" in err
    assert "Traceback" not in err and not out.exists()


def test_batch_reports_a_csv_field_over_the_limit_by_line(tmp_path, capsys):
    import csv

    src = tmp_path / "q.csv"
    src.write_text(
        "id,question,config\n"
        + f'big,"{"x" * (csv.field_size_limit() + 1)}",\n'
        + 'ok,Who?,"{""top_k"": 0}"\n'
    )
    out = tmp_path / "answers.jsonl"
    assert main(["batch", str(src), "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"{src}:2: a field is longer than the csv module's limit" in err
    assert "Traceback" not in err
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids == ["2", "ok"]


DEEP = "[" * 100_000 + "]" * 100_000  # past the JSON parser's recursion limit
HUGE_INT = "9" * 5000  # past Python's 4,300-digit int() limit


def test_batch_turns_hostile_rows_into_error_records_not_a_traceback(tmp_path, capsys):
    src = tmp_path / "q.jsonl"
    src.write_text(
        f'{{"id": "deep", "question": "Who?", "config": {DEEP}}}\n'
        f'{{"id": "huge", "question": "Who?", "config": {{"top_k": {HUGE_INT}}}}}\n'
        '{"id": "bad", "question": "Who?", "config": {"top_k": 0}}\n'
    )
    out = tmp_path / "answers.jsonl"
    assert main(["batch", str(src), "--out", str(out), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert f"{src}:1: the row has arrays or objects nested too deeply" in captured.err
    assert "failed=1 skipped=0 retried=0 malformed=2" in captured.out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["error"]["type"]) for r in records] == [
        ("1", "malformed"),
        ("2", "malformed"),
        ("bad", "invalid"),
    ]


@pytest.mark.parametrize("body", [DEEP, f'{{"question": "Who?", "n": {HUGE_INT}}}'])
def test_eval_refuses_a_hostile_dataset_with_a_message(tmp_path, capsys, body):
    data = tmp_path / "qa.jsonl"
    data.write_text(body + "\n")
    assert main(["eval", str(data), "--no-progress", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{data}:1: not a {{question, golden_answers}} record" in err
    assert "Traceback" not in err


def test_a_recursion_error_anywhere_is_a_message_not_a_traceback(monkeypatch, capsys):
    import selfrag.cli as cli

    def deep(_args):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setitem(cli.COMMANDS, "config", deep)
    assert main(["config"]) != 0
    err = capsys.readouterr().err
    assert "selfrag: input nested too deeply to process" in err
    assert "Traceback" not in err


def test_eval_without_corpus_on_an_empty_index_says_what_to_do(tmp_path, capsys):
    data = tmp_path / "squad.json"
    qa = {"id": "q1", "question": "Who?", "answers": [{"text": "Rollo"}]}
    paragraph = {"context": "Rollo founded Normandy.", "qas": [qa]}
    data.write_text(json.dumps({"data": [{"title": "T", "paragraphs": [paragraph]}]}))
    assert main(["eval", str(data), "--no-progress", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is empty: run `selfrag index PATH` first, or pass --corpus" in err
