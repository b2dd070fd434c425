"""Corpus-calibrated support thresholds on disk: one JSON file per model file, index collection
and critique.

The default collection's (`DEFAULT_COLLECTION`) is `$SELFRAG_HOME/calibration/<model
sha256>/<critique>.json`, where every calibration lived before they were kept per collection,
so a home's existing files still apply to it; another collection's is
`.../<model sha256>/collections/<collection>/<critique>.json` (a folder of its own: a collection
name may end in `.json`). A home served with another model file, collection or critique source
never reads this one's threshold.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import ValidationError

from selfrag.infra.corpus.bounded_reads import load_json
from selfrag.infra.file_lock import write_atomic
from selfrag.schemas.calibration import SupportCalibration
from selfrag.schemas.settings import DEFAULT_COLLECTION

log = logging.getLogger(__name__)

CALIBRATION_DIR = "calibration"
COLLECTIONS_DIR = "collections"
# A calibration nests three levels; a file far deeper is not one (and must not recurse).
MAX_JSON_DEPTH = 32


def calibration_folder(home: Path, model_sha256: str, collection: str = DEFAULT_COLLECTION) -> Path:
    """Where the calibrations of this model file on `collection` are kept."""
    folder = home / CALIBRATION_DIR / model_sha256
    return folder if collection == DEFAULT_COLLECTION else folder / COLLECTIONS_DIR / collection


def calibration_path(
    home: Path, model_sha256: str, critique: str, collection: str = DEFAULT_COLLECTION
) -> Path:
    return calibration_folder(home, model_sha256, collection) / f"{critique}.json"


def save_calibration(home: Path, cal: SupportCalibration) -> Path:
    """Write `cal` atomically (a reader sees the old file or the new one), under the
    collection it was fitted on."""
    collection = cal.index_collection or DEFAULT_COLLECTION
    path = calibration_path(home, cal.model_sha256, cal.critique, collection)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (cal.model_dump_json(indent=2) + "\n").encode(), mode=0o644)
    return path


def read_calibration(
    home: Path, model_sha256: str, critique: str, collection: str = DEFAULT_COLLECTION
) -> SupportCalibration | None:
    """The calibration of this model file, critique and collection in `home`; None when
    there is none or it cannot be read (logged: the caller falls back to the source's
    constant)."""
    path = calibration_path(home, model_sha256, critique, collection)
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
    fitted_on = cal.index_collection or DEFAULT_COLLECTION  # None: written before collections
    if cal.model_sha256 != model_sha256 or cal.critique != critique or fitted_on != collection:
        log.warning(
            "ignoring %s: it was written for another model file, critique or collection", path
        )
        return None
    return cal
