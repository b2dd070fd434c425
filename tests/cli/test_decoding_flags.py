"""cli/decoding_flags.py: one flag per decoding dial, a mapping dial as repeated NAME=SCORE."""

from __future__ import annotations

import argparse

import pytest

from selfrag.cli.decoding_flags import add_decoding_flags
from selfrag.schemas.decoding import DecodingOverrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_decoding_flags(parser)
    return parser


def test_every_dial_is_a_flag_left_unset_by_default() -> None:
    args = _parser().parse_args([])
    assert {name: getattr(args, name) for name in DecodingOverrides.model_fields} == dict.fromkeys(
        DecodingOverrides.model_fields
    )


def test_a_threshold_per_corpus_is_a_repeated_name_score_flag() -> None:
    flag = "--min-support-score-by-corpus"
    args = _parser().parse_args([flag, "a.json=0.2", flag, "docs=x=0.3", flag, "a.json=0.25"])
    assert args.min_support_score_by_corpus == {"a.json": 0.25, "docs=x": 0.3}


@pytest.mark.parametrize("value", ["a.json", "a.json=", "a.json=high"])
def test_a_malformed_name_score_is_a_usage_error(value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--min-support-score-by-corpus", value])
    assert exc.value.code == 2
    assert "expected NAME=SCORE" in capsys.readouterr().err
