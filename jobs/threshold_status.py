"""Where a support threshold comes from, for `selfrag status`: the calibration saved for the
model file, critique source and index collection (`jobs.support_calibration`), else the
source's constant. Reads no model."""

from __future__ import annotations

from pathlib import Path

from selfrag.pipeline.critics.filters import settle_filters
from selfrag.schemas.decoding import DecodingConfig


def threshold_status(
    home: Path, model_sha256: str, critique: str, index_version: str, collection: str
) -> dict[str, object]:
    """Where the support threshold of `critique` on this model file and index `collection`
    comes from, for `selfrag status`: the calibration (and whether the index changed since),
    else the source's constant (or none). Reads no model."""
    from selfrag.infra.calibration_files import calibration_path, read_calibration

    cal = read_calibration(home, model_sha256, critique, collection)
    if cal is None:
        value = settle_filters(DecodingConfig(), critique).min_support_score
        return {"min_support_score": value, "calibrated": False}
    return {
        "min_support_score": cal.min_support_score,
        "by_corpus": cal.corpus_thresholds(),
        "calibrated": True,
        "file": str(calibration_path(home, model_sha256, critique, collection)),
        "questions": cal.questions,
        "created": cal.created,
        "index_changed": cal.index_version != index_version,
    }


def describe_threshold(t: dict[str, object]) -> str:
    """`threshold_status` on one line."""
    if not t["calibrated"]:
        if not t["min_support_score"]:
            return "off (not calibrated: `selfrag calibrate`)"
        value = t["min_support_score"]
        return f"{value} (constant, not calibrated on this corpus: `selfrag calibrate`)"
    changed = "; the index changed since: `selfrag calibrate`" if t["index_changed"] else ""
    own = t.get("by_corpus") or {}
    assert isinstance(own, dict)
    per_collection = (
        "; per corpus " + ", ".join(f"{name or '(unnamed)'} {v}" for name, v in own.items())
        if len(own) > 1
        else ""
    )
    return (
        f"{t['min_support_score']} (calibrated on {t['questions']} synthetic questions from the "
        f"index, {t['created']}{changed}{per_collection})"
    )
