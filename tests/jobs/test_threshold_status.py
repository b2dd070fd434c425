"""jobs/threshold_status.py: where `selfrag status` says a support threshold comes from."""

from __future__ import annotations

from pathlib import Path

from selfrag.infra.calibration_files import calibration_path, save_calibration
from selfrag.jobs.threshold_status import describe_threshold, threshold_status
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.settings import DEFAULT_COLLECTION
from tests.fakes import support_calibration

SHA = "a" * 64
# The default request as the answer path settles it without a calibration: the filter off.
LEARNED = DecodingConfig(critique="learned", min_support_score=0.0)
LIKELIHOOD = DecodingConfig(critique="likelihood", min_support_score=0.0)


def test_without_a_calibration_the_settled_value_or_off(tmp_path: Path) -> None:
    t = threshold_status(tmp_path, SHA, LEARNED, "v1", DEFAULT_COLLECTION)
    assert t == {"min_support_score": 0.0, "calibrated": False}
    off = {"min_support_score": 0.0, "calibrated": False}
    assert describe_threshold(off) == "off (not calibrated: `selfrag calibrate`)"
    assert describe_threshold({"min_support_score": 0.36, "calibrated": False}).startswith(
        "0.36 (constant, not calibrated on this corpus"
    )


def test_a_calibration_says_its_file_and_whether_the_index_changed_since(tmp_path: Path) -> None:
    save_calibration(tmp_path, support_calibration())
    same = threshold_status(tmp_path, SHA, LEARNED, "v1", DEFAULT_COLLECTION)
    assert same == {
        "min_support_score": 0.52,
        "by_corpus": {},
        "calibrated": True,
        "file": str(calibration_path(tmp_path, SHA, "learned", DEFAULT_COLLECTION)),
        "questions": 40,
        "created": "2026-12-03T00:00:00+00:00",
        "index_changed": False,
    }
    assert describe_threshold(same) == (
        "0.52 (calibrated on 40 synthetic questions from the index, 2026-12-03T00:00:00+00:00)"
    )
    changed = threshold_status(tmp_path, SHA, LEARNED, "v2", DEFAULT_COLLECTION)
    assert changed["index_changed"] is True
    assert describe_threshold(changed).endswith("; the index changed since: `selfrag calibrate`)")
    # Another source on the same model file has none.
    other = threshold_status(tmp_path, SHA, LIKELIHOOD, "v1", DEFAULT_COLLECTION)
    assert other["calibrated"] is False


def test_a_calibration_of_several_collections_names_each_ones_threshold(tmp_path: Path) -> None:
    own = {"squad.json": {"threshold": 0.61}, "wiki.jsonl": {"threshold": 0.52}}
    save_calibration(tmp_path, support_calibration(collections=own))
    t = threshold_status(tmp_path, SHA, LEARNED, "v1", DEFAULT_COLLECTION)
    assert t["by_corpus"] == {"squad.json": 0.61, "wiki.jsonl": 0.52}
    assert describe_threshold(t).endswith("; per corpus squad.json 0.61, wiki.jsonl 0.52)")


def test_a_threshold_set_in_the_settings_is_what_status_shows(tmp_path: Path) -> None:
    # Even with a calibration on disk: the settings' value is what answers are held to.
    save_calibration(tmp_path, support_calibration())
    settled = DecodingConfig(critique="learned", min_support_score=0.4)
    t = threshold_status(tmp_path, SHA, settled, "v1", DEFAULT_COLLECTION, configured=True)
    assert t == {"min_support_score": 0.4, "calibrated": False, "set": True}
    assert describe_threshold(t) == "0.4 (set in the settings: decoding.min_support_score)"
