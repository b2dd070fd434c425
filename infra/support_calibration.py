"""Corpus-calibrated support thresholds on disk: one JSON file per model file and critique.

`$SELFRAG_HOME/calibration/<model sha256>/<critique>.json` holds a `SupportCalibration`, so a
home served with another model file (or critique source) never reads this one's threshold.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import ValidationError

from selfrag.infra.corpus import load_json
from selfrag.infra.file_lock import write_atomic
from selfrag.schemas.calibration import SupportCalibration

log = logging.getLogger(__name__)

CALIBRATION_DIR = "calibration"
# A calibration nests three levels; a file far deeper is not one (and must not recurse).
MAX_JSON_DEPTH = 32


def calibration_path(home: Path, model_sha256: str, critique: str) -> Path:
    return home / CALIBRATION_DIR / model_sha256 / f"{critique}.json"


def save_calibration(home: Path, cal: SupportCalibration) -> Path:
    """Write `cal` atomically (a reader sees the old file or the new one)."""
    path = calibration_path(home, cal.model_sha256, cal.critique)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (cal.model_dump_json(indent=2) + "\n").encode(), mode=0o644)
    return path


def read_calibration(home: Path, model_sha256: str, critique: str) -> SupportCalibration | None:
    """The calibration of this model file and critique in `home`; None when there is none or
    it cannot be read (logged: the caller falls back to the source's constant)."""
    path = calibration_path(home, model_sha256, critique)
    if not path.is_file():
        return None
    try:
        doc = load_json(path.read_text(encoding="utf-8"), MAX_JSON_DEPTH)
        cal = SupportCalibration.model_validate(doc)
    except (OSError, ValueError, ValidationError) as exc:  # JSONInputError: deep nesting too
        log.warning(
            "ignoring the unreadable calibration %s (%s): rerun `selfrag calibrate`", path, exc
        )
        return None
    if cal.model_sha256 != model_sha256 or cal.critique != critique:
        log.warning("ignoring %s: it was written for another model file or critique", path)
        return None
    return cal


def list_calibrations(home: Path, model_sha256: str) -> list[SupportCalibration]:
    """Every readable calibration of this model file in `home`, by critique name."""
    folder = home / CALIBRATION_DIR / model_sha256
    if not folder.is_dir():
        return []
    found = (read_calibration(home, model_sha256, p.stem) for p in sorted(folder.glob("*.json")))
    return [c for c in found if c is not None]
