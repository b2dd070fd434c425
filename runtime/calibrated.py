"""The support thresholds calibrated on the served corpus, as one process reads them.

`selfrag calibrate` (and the end of `selfrag index`) writes a `SupportCalibration` per model
file, index collection and critique source; answers whose request leaves `min_support_score`
unset take their index collection's, and each corpus's own threshold, when the
answer path settles their config (`pipeline.critics.filters.settle_filters`, with the
`CritiqueFacts` of the runtime on that collection). Without a calibration the threshold is
off, which is logged once per process, model file, collection and source (`selfrag ask`
calibrates on first use instead: `cli/first_use.py`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from selfrag.infra.calibration_files import calibration_path, read_calibration
from selfrag.schemas.calibration import SupportCalibration
from selfrag.schemas.settings import DEFAULT_COLLECTION

log = logging.getLogger(__name__)

_warned_lock = threading.Lock()
_warned: set[tuple[str, str, str]] = set()


class CalibratedDefaults:
    """The calibrated filter defaults of one home, model file and index collection, read once
    per process (and again after `forget`, which the calibration job calls when it writes a
    new one)."""

    def __init__(
        self,
        home: Path,
        model_sha256: Callable[[], str],
        fingerprint: Callable[[], str],
        collection: str = DEFAULT_COLLECTION,
    ) -> None:
        self._home = home
        self._sha = model_sha256
        self._fingerprint = fingerprint
        self.collection = collection
        self._lock = threading.Lock()
        self._read: dict[str, SupportCalibration | None] = {}

    def for_collection(self, collection: str) -> CalibratedDefaults:
        """The calibrated defaults of the same home and model file on `collection`."""
        return CalibratedDefaults(self._home, self._sha, self._fingerprint, collection)

    def calibration(self, critique: str) -> SupportCalibration | None:
        """The calibration of `critique` on this model file and collection; None when there
        is none, or it was made with other heads or another answerability model (logged)."""
        with self._lock:
            if critique not in self._read:
                self._read[critique] = self._load(critique)
            return self._read[critique]

    def _load(self, critique: str) -> SupportCalibration | None:
        cal = read_calibration(self._home, self._sha(), critique, self.collection)
        if cal is not None and cal.fingerprint != self._fingerprint():
            log.warning(
                "not using the support threshold in %s: it was calibrated for %s, this model "
                "is %s; rerun `selfrag calibrate`",
                calibration_path(self._home, cal.model_sha256, critique, self.collection),
                cal.fingerprint,
                self._fingerprint(),
            )
            return None
        return cal

    def filters(self, critique: str) -> dict[str, object]:
        """The filter defaults calibrated for `critique`: its `min_support_score` (for passages
        of a collection without its own) and each collection's own threshold; empty without a
        calibration, which is logged once (answers then never abstain for support)."""
        cal = self.calibration(critique)
        if cal is not None:
            return {
                "min_support_score": cal.min_support_score,
                "min_support_score_by_corpus": cal.corpus_thresholds(),
            }
        warn_uncalibrated(self._sha(), critique, self.collection)
        return {}

    def forget(self) -> None:
        """Read the calibrations from disk again at the next answer."""
        with self._lock:
            self._read.clear()


def warn_uncalibrated(
    model_sha256: str, critique: str, collection: str = DEFAULT_COLLECTION
) -> None:
    """Log (WARNING) once per process, model file, collection and source that no support
    threshold was calibrated on this corpus."""
    with _warned_lock:
        if (model_sha256, critique, collection) in _warned:
            return
        _warned.add((model_sha256, critique, collection))
    flag = "" if collection == DEFAULT_COLLECTION else f" --collection {collection}"
    log.warning(
        "critique '%s': no support threshold was calibrated on the collection '%s' for this "
        "model, so answers do not abstain for lack of support: run `selfrag calibrate%s`",
        critique,
        collection,
        flag,
    )
