"""Calibrating the support threshold on the first answer of a model that has none.

A `LocalRuntime` given `calibrate_on_first_use` runs it when it settles the first request for
a critique source without a threshold on its collection (`LocalRuntime.calibrated_filters`):
the Python API, `selfrag ask`, the HTTP app in one process, batch and evaluation all settle
there. A server settles its default request once before it serves (`calibrate_before_serving`):
its replicas do not own the store, so they only read what was calibrated.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from selfrag.runtime.system import LocalRuntime

if TYPE_CHECKING:
    from selfrag.schemas.settings import Settings

log = logging.getLogger("selfrag.first_use")


def calibrate_on_first_use(rag: LocalRuntime, critique: str) -> bool:
    """Fit the support threshold of `critique` on `rag`'s collection once, with a progress
    bar on a terminal, when the model file has none for it there (answers would never abstain
    for lack of support) and `model.calibrate_on_first_use` allows it. True when it wrote one.
    An empty collection has nothing to calibrate on; one too small to calibrate on is logged,
    and abstention stays off."""
    from selfrag.jobs.support_calibration import (
        CalibrationSkipped,
        calibrate_support,
        corpus_plan,
    )
    from selfrag.jobs.threshold_status import describe_calibration

    if rag.settings.model.backend != "llama_cpp" or not rag.settings.model.calibrate_on_first_use:
        return False
    name = rag.critique_name(critique)  # from the model's files: no engine loaded for it
    if rag.calibrated.calibration(name) is not None or rag.store.count() == 0:
        return False
    print(
        f"selfrag: no support threshold for {rag.model.path.name} and critique '{name}' on the "
        f"collection '{rag.settings.retrieval.collection}' yet: calibrating it once now "
        "(`selfrag calibrate` does it alone)",
        file=sys.stderr,
    )
    try:
        cal, path = calibrate_support(
            rag, corpus_plan(), critique=critique, progress=sys.stderr.isatty()
        )
    except CalibrationSkipped as exc:
        log.warning("support threshold not calibrated (%s): answers will not abstain", exc)
        return False
    print(describe_calibration(cal, path), file=sys.stderr)
    return True


def answering_runtime(settings: Settings) -> LocalRuntime:
    """A runtime that answers in this process (it owns the store) and so calibrates a missing
    support threshold on first use."""
    return LocalRuntime(settings, first_use=calibrate_on_first_use)


def calibrate_before_serving(settings: Settings, rag: LocalRuntime | None = None) -> None:
    """What a server's first answer would calibrate, done before it serves: the default request
    settled once in a runtime that owns the store (`rag`, when the caller has one open that
    calibrates on first use; else one of its own, closed before the replicas open the store)."""
    model = settings.model
    if model.backend != "llama_cpp" or not model.calibrate_on_first_use:
        return
    if rag is None:
        with answering_runtime(settings) as own:
            return calibrate_before_serving(settings, own)
    if rag.store.count() > 0:  # an empty collection has nothing to calibrate on
        rag.answer_path.settle(settings.decoding)
    return None
