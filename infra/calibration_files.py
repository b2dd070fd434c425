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


class CalibrationFileError(ValueError):
    """A calibration file that cannot be used; the message names it and says what to do,
    `reason` says why alone."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"ignoring the support calibration {path}: {reason}; run `selfrag calibrate` to "
            "fit it again (or delete the file)"
        )
        self.path = path
        self.reason = reason


def read_calibration(
    home: Path, model_sha256: str, critique: str, collection: str = DEFAULT_COLLECTION
) -> SupportCalibration | None:
    """The calibration of this model file, critique and collection in `home`; None when
    there is none or it cannot be used (`load_calibration`'s error is logged: the caller goes
    on without a threshold, or fits one)."""
    try:
        return load_calibration(home, model_sha256, critique, collection)
    except CalibrationFileError as exc:
        log.warning("%s", exc)
        return None


def load_calibration(
    home: Path, model_sha256: str, critique: str, collection: str = DEFAULT_COLLECTION
) -> SupportCalibration | None:
    """The calibration of this model file, critique and collection in `home`, None when there
    is none; `CalibrationFileError` when its file cannot be read, holds a value a fit cannot
    give (a threshold that is not a finite number in [0, 1], ...), or was written for another
    model file, critique or collection."""
    path = calibration_path(home, model_sha256, critique, collection)
    if not path.is_file():
        return None
    try:
        doc = load_json(path.read_text(encoding="utf-8"), MAX_JSON_DEPTH)
        cal = SupportCalibration.model_validate(doc)
    except ValidationError as exc:
        raise CalibrationFileError(path, invalid_fields(exc)) from None
    except (OSError, ValueError) as exc:  # JSONInputError: deep nesting too
        raise CalibrationFileError(path, f"unreadable calibration ({exc})") from None
    fitted_on = cal.index_collection or DEFAULT_COLLECTION  # None: written before collections
    if cal.model_sha256 != model_sha256 or cal.critique != critique or fitted_on != collection:
        raise CalibrationFileError(
            path, "it was written for another model file, critique or collection"
        )
    return cal


def invalid_fields(exc: ValidationError, shown: int = 3) -> str:
    """What a validation error found, on one line without pydantic's links: `field.path:
    message` for the first `shown` fields."""
    errors = exc.errors(include_url=False)
    parts = [
        f"{'.'.join(str(p) for p in e['loc']) or 'the file'}: {e['msg']}" for e in errors[:shown]
    ]
    more = f" (and {len(errors) - shown} more)" if len(errors) > shown else ""
    return "; ".join(parts) + more
