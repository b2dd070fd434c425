"""Support thresholds described for the terminal: where one comes from, for `selfrag status`
(the settings, else the calibration saved for the model file, critique source and index
collection, else none; reads no model), and what a calibration chose
(`jobs.support_calibration`)."""

from __future__ import annotations

from pathlib import Path

from selfrag.schemas.calibration import SupportCalibration
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.settings import DEFAULT_COLLECTION


def threshold_status(
    home: Path,
    model_sha256: str,
    settled: DecodingConfig,
    index_version: str,
    collection: str,
    *,
    configured: bool = False,
) -> dict[str, object]:
    """Where the support threshold of the default request comes from, for `selfrag status`:
    `settled` is that request's config as the answer path settles it (its critique source the
    concrete one), `configured` whether the settings set `min_support_score` themselves. Then
    the settings, else the calibration of the source on this model file and index
    `collection` (and whether the index changed since), else none (off). Reads no model."""
    from selfrag.infra.calibration_files import calibration_path, read_calibration

    if configured:
        return {"min_support_score": settled.min_support_score, "calibrated": False, "set": True}
    cal = read_calibration(home, model_sha256, settled.critique, collection)
    if cal is None:
        return {"min_support_score": settled.min_support_score, "calibrated": False}
    return {
        "min_support_score": cal.min_support_score,
        "by_corpus": cal.corpus_thresholds(),
        "calibrated": True,
        "file": str(calibration_path(home, model_sha256, settled.critique, collection)),
        "questions": cal.questions,
        "created": cal.created,
        "index_changed": cal.index_version != index_version,
    }


def describe_threshold(t: dict[str, object]) -> str:
    """`threshold_status` on one line."""
    if t.get("set"):
        return f"{t['min_support_score']} (set in the settings: decoding.min_support_score)"
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


def describe_calibration(cal: SupportCalibration, path: Path) -> str:
    """What a calibration chose and from what, for the terminal."""
    a, u = cal.answerable, cal.unanswerable
    unans = "-" if cal.unanswerable_abstain is None else f"{cal.unanswerable_abstain:.0%}"
    return "\n".join(
        [
            f"support threshold ({cal.critique}, {cal.model_file}, collection "
            f"{cal.index_collection or DEFAULT_COLLECTION}): min_support_score "
            f"{cal.min_support_score:.4f} -> {path}",
            f"  {cal.questions} synthetic questions ({cal.style}); support score answerable "
            f"n={a.get('n')} p10 {a.get('p10', '-')} p50 {a.get('p50', '-')}, unanswerable "
            f"n={u.get('n')} p10 {u.get('p10', '-')} p50 {u.get('p50', '-')}; AUROC "
            f"{'-' if cal.auroc is None else f'{cal.auroc:.3f}'}"
            + "".join(
                f", {trap} {'-' if a is None else f'{a:.3f}'}"
                for trap, a in cal.auroc_by_trap.items()
            ),
            f"  abstains on {cal.answerable_abstain:.0%} of answerable pairs (at most "
            f"{cal.max_answerable_abstain:.0%}), {unans} of unanswerable; {cal.seconds:.0f} s",
            *(
                f"  corpus {name or '(unnamed)'}: {c['threshold']:.4f}"
                + (
                    " (also for passages of other corpora: the lowest)"
                    if name == cal.threshold_collection
                    else ""
                )
                for name, c in sorted(cal.collections.items())
            ),
        ]
    )
