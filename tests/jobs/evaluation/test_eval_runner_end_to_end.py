"""`selfrag eval` and `selfrag calibrate` end to end with the real model and the session index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfrag.cli import main
from selfrag.jobs.evaluation.eval_report import REPORT_COLUMNS

# The report columns that are fractions (the rest are latencies and token counts).
RATES = tuple(c for c in REPORT_COLUMNS if c not in {"p50_ms", "p95_ms", "prefill_tokens"})


def test_eval_reports_every_system_and_column(
    indexed_home: Path,
    normans_squad: Path,
    indexed_corpus: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    out = tmp_path / "eval"
    args = [
        "--home",
        str(indexed_home),
        "eval",
        str(normans_squad),
        "--corpus",
        *indexed_corpus,
        "--systems",
        "closed-book,vanilla-rag,selfrag-likelihood",
        "--limit",
        "3",
        "--out",
        str(out),
        "--no-progress",
        "--plot",
        "--table",  # every column: the short summary is the default
        "--top-k",
        "2",
        "--max-segments",
        "1",
        "--max-segment-tokens",
        "24",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| selfrag-likelihood |" in printed
    report = json.loads((out / "report.json").read_text())
    assert set(report["systems"]) == {"closed-book", "vanilla-rag", "selfrag-likelihood"}
    for name, row in report["systems"].items():
        assert set(REPORT_COLUMNS) <= set(row), name
        assert row["questions"] == 3
        for col in RATES:
            assert row[col] is None or 0.0 <= row[col] <= 1.0, (name, col)
        assert 0 < row["p50_ms"] <= row["p95_ms"]
        assert row["prefill_tokens"] > 0
    assert report["systems"]["closed-book"]["retrieval_rate"] == 0.0
    assert report["systems"]["vanilla-rag"]["retrieval_rate"] == 1.0
    assert (out / "accuracy_vs_threshold.png").stat().st_size > 0
    assert (out / "support_reliability.png").stat().st_size > 0
    # Abstention as a decision with a curve: a score per record, the curve, its outputs.
    assert "| system | abstention score | coverage |" in printed
    assert (out / "accuracy_coverage.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "accuracy_coverage.csv").read_text().startswith("system,threshold,")
    for name, row in report["systems"].items():
        for col in ("coverage", "selective_accuracy", "abstention_auroc"):
            assert row[col] is None or 0.0 <= row[col] <= 1.0, (name, col)
        assert row["abstention_auroc"] is not None or row["abstention_auroc_reason"], name
        points = report["accuracy_coverage"][name]
        assert points and points[-1]["coverage"] == row["coverage"], name
    scored = [
        r
        for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())
        if r["system"] == "selfrag-likelihood"
    ]
    assert any(r["abstention_score"] is not None for r in scored)
    # A rerun resumes: every record is already there, nothing is answered again. Without
    # --corpus it uses the index as it is.
    lines = (out / "records.jsonl").read_text().count("\n")
    start = args.index("--corpus")
    assert main(args[:start] + args[start + 1 + len(indexed_corpus) :]) == 0
    assert "indexing" not in capsys.readouterr().err
    assert (out / "records.jsonl").read_text().count("\n") == lines


def test_calibrate_dry_run_fits_every_signal(
    indexed_home: Path,
    normans_squad: Path,
    indexed_corpus: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    samples = tmp_path / "samples.jsonl"
    assert (
        main(
            [
                "--home",
                str(indexed_home),
                "calibrate",
                str(normans_squad),
                "--corpus",
                *indexed_corpus,
                "--limit",
                "2",
                "--top-k",
                "2",
                "--max-segment-tokens",
                "16",
                "--samples",
                str(samples),
                "--dry-run",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for signal in ("relevance", "support", "retrieval", "utility"):
        assert signal in out
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert {r["signal"] for r in rows} == {"relevance", "support", "retrieval", "utility"}
    assert not (indexed_home / "calibration.toml").exists()


LONGFORM_FIXTURE = Path(__file__).with_name("longform_fixture.jsonl")


def test_eval_reports_long_answers_end_to_end(
    indexed_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    out = tmp_path / "long"
    args = [
        "--home",
        str(indexed_home),
        "eval",
        str(LONGFORM_FIXTURE),
        "--split",
        "tune",
        "--limit",
        "2",
    ]
    args += ["--systems", "vanilla-rag-long,selfrag-learned", "--out", str(out), "--no-progress"]
    args += ["--top-k", "2", "--max-segments", "2", "--max-segment-tokens", "24"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "facts stated: first / second" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["longform_questions"] == 2
    for name in ("vanilla-rag-long", "selfrag-learned"):
        row = report["longform"][name]
        assert row["questions"] == 2 and row["facts"] == 6, name
        for col in ("fact_recall", "fully_covered", "facts_retrieved", "abstain_rate"):
            assert 0.0 <= row[col] <= 1.0, (name, col)
        for col in ("citation_recall", "citation_precision", "citation_precision_facts"):
            assert row[col] is None or 0.0 <= row[col] <= 1.0, (name, col)
        assert row["prefill_tokens"] > 0 and row["mean_ms"] > 0
    pair = report["paired"][0]
    assert pair["facts_stated"]["facts"] == 6 and pair["fully_covered"]["questions"] == 2
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    for r in records:
        given = {p["id"] for p in r["passages"]}
        assert given, r["system"]
        for unit in r["units"]:
            # A baseline's [n] names one of the passages it was shown, or stays "[n]".
            assert all(c in given or c.startswith("[") for c in unit["cited"]), unit
    answers = (out / "longform_answers.jsonl").read_text().splitlines()
    assert len(answers) == 4
    for a in report["longform_answers"]:
        assert a["latency_ms"] > 0 and len(a["facts"]) == 3, a
        assert all(u["supported"] in (True, False, None) for u in a["units"]), a
    assert "| vanilla-rag-long | 2 | 6 |" in (out / "report.md").read_text()
