"""Calibrating the support threshold on the first answer of a model that has none."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selfrag.runtime.system import LocalRuntime
    from selfrag.schemas.settings import Settings

log = logging.getLogger("selfrag.cli")


def calibrate_on_first_use(rag: LocalRuntime, critique: str, progress: bool = True) -> bool:
    """Fit the support threshold of `critique` on `rag`'s collection once, with a progress
    bar, when the model file has none for it there (answers would never abstain for lack of
    support). True when it ran. A corpus too small to calibrate on is logged, and abstention
    stays off."""
    from selfrag.jobs.support_calibration import (
        CalibrationSkipped,
        calibrate_support,
        corpus_plan,
    )
    from selfrag.jobs.threshold_status import describe_calibration

    if rag.settings.model.backend != "llama_cpp" or not rag.settings.model.calibrate_on_first_use:
        return False
    name = rag.critique_name(critique)  # from the model's files: no engine loaded for it
    if rag.calibrated.calibration(name) is not None:
        return False
    print(
        f"selfrag: no support threshold for {rag.model.path.name} and critique '{name}' on the "
        f"collection '{rag.settings.retrieval.collection}' yet: calibrating it once now "
        "(`selfrag calibrate` does it alone)",
        file=sys.stderr,
    )
    try:
        cal, path = calibrate_support(rag, corpus_plan(), critique=critique, progress=progress)
    except CalibrationSkipped as exc:
        log.warning("support threshold not calibrated (%s): answers will not abstain", exc)
        return False
    print(describe_calibration(cal, path), file=sys.stderr)
    return True


def calibrate_before_answering(settings: Settings, rag: LocalRuntime | None = None) -> bool:
    """`calibrate_on_first_use` for a server or a batch about to answer on `settings`'
    collection with its default critique, in `rag` when the caller has one open (and closes it
    before they start), else in a runtime of its own closed before they start (the embedded
    store admits one process). The progress bar only on a terminal; an empty collection has
    nothing to calibrate on. True when it ran."""
    from selfrag.runtime.system import LocalRuntime

    model = settings.model
    if model.backend != "llama_cpp" or not model.calibrate_on_first_use:
        return False
    if rag is not None:
        return _calibrate_collection(rag, settings)
    with LocalRuntime(settings) as own:
        return _calibrate_collection(own, settings)


def _calibrate_collection(rag: LocalRuntime, settings: Settings) -> bool:
    if rag.store.count() == 0:
        return False
    return calibrate_on_first_use(rag, settings.decoding.critique, progress=sys.stderr.isatty())


def calibrate_eval_systems(rag: LocalRuntime, systems: list[str], progress: bool) -> list[str]:
    """`calibrate_on_first_use` for the critique source of each Self-RAG system an evaluation
    is about to answer with on `rag`'s collection, since an evaluation measures what a user's
    answers get (the native source only on a Self-RAG checkpoint: the evaluation refuses it
    elsewhere). The sources calibrated now."""
    if rag.store.count() == 0:
        return []
    sources = [s.removeprefix("selfrag-") for s in systems if s.startswith("selfrag-")]
    if "native" in sources:
        from selfrag.pipeline.critics.native import native_token_ids

        if native_token_ids(rag.engine) is None:
            sources.remove("native")
    return [s for s in sources if calibrate_on_first_use(rag, s, progress=progress)]
