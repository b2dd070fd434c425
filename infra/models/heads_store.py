"""Reflection heads on disk: one JSON file per model file, named by the file's SHA-256.

`selfrag train` writes `$SELFRAG_HOME/heads/<sha256>.json`; the repository ships the heads of
the embedded default under `infra/models/shipped_heads/`. A file holds the weight rows (float32,
base64) and the training manifest (data, counts, seed, validation AUC per group).
Answerability models (`pipeline.answerability_model`) sit beside them, one per model file and
critique
source: `$SELFRAG_HOME/answerability/<sha256>.<source>.json`, shipped as
`shipped_heads/<sha256>.answerability.<source>.json`.
Files trained at the read positions of an earlier selfrag (`READ_LAYOUT`) are passed over by
the lookups, with a warning, and refused when named.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from selfrag.infra.corpus.bounded_reads import JSONInputError, load_json
from selfrag.infra.file_lock import write_atomic
from selfrag.pipeline.answerability_model import AnswerabilityError, AnswerabilityModel
from selfrag.pipeline.critics import READ_LAYOUT
from selfrag.pipeline.heads import (
    GROUP_LABELS,
    HALF_MAX,
    GroupHead,
    HeadsError,
    ReflectionHeads,
)

HEADS_FORMAT = 1
# Heads and answerability files nest four levels; anything far deeper is not one of them.
MAX_JSON_DEPTH = 32
SHIPPED_DIR = Path(__file__).with_name("shipped_heads")
log = logging.getLogger(__name__)
_warned: set[Path] = set()


def heads_path(home: Path, model_sha256: str) -> Path:
    return home / "heads" / f"{model_sha256}.json"


def find_heads(home: Path, model_sha256: str) -> Path | None:
    """The heads file for a model file: trained here first, else shipped, else None."""
    return _first_current((heads_path(home, model_sha256), SHIPPED_DIR / f"{model_sha256}.json"))


def _first_current(paths: tuple[Path, ...]) -> Path | None:
    """The first of `paths` that is a file, passing over (with a warning) one trained at the
    read positions of an earlier selfrag."""
    for path in paths:
        if not path.is_file():
            continue
        try:
            layout = read_manifest(path).get("layout")
        except (OSError, ValueError):
            return path  # unreadable: loading it says why
        if layout == READ_LAYOUT:
            return path
        if path not in _warned:
            _warned.add(path)
            log.warning(
                "%s was trained at the read positions %r of an earlier selfrag, not %r: "
                "ignored (train it again)",
                path,
                layout,
                READ_LAYOUT,
            )
    return None


def save_heads(
    path: Path,
    model_sha256: str,
    weights: dict[str, np.ndarray],
    manifest: dict[str, Any],
) -> ReflectionHeads:
    """Write heads (group → array of shape (labels, hidden)) atomically, the manifest stamped
    with the read positions they were trained at (`READ_LAYOUT`); returns them."""
    groups: dict[str, Any] = {}
    for name, labels in GROUP_LABELS.items():
        w = np.asarray(weights[name], dtype=np.float32)
        if w.ndim != 2 or w.shape[0] != len(labels):
            raise HeadsError(f"group {name!r}: weights of shape {w.shape} for labels {labels}")
        groups[name] = {
            "labels": list(labels),
            "shape": list(w.shape),
            "float32_base64": base64.b64encode(np.ascontiguousarray(w).tobytes()).decode(),
        }
    doc = {
        "format": HEADS_FORMAT,
        "model_sha256": model_sha256,
        "groups": groups,
        "manifest": {**manifest, "layout": READ_LAYOUT},
    }
    _write_json(path, doc)
    return load_heads(path)


def load_heads(path: Path) -> ReflectionHeads:
    """Read a heads file; a malformed one is a `HeadsError` naming the file."""
    try:
        doc = _read_json(path)
        if doc.get("format") != HEADS_FORMAT:
            raise HeadsError(f"format {doc.get('format')!r}, expected {HEADS_FORMAT}")
        check_layout(doc.get("manifest", {}).get("layout"), HeadsError, "`selfrag train`")
        groups = {}
        for name, g in doc["groups"].items():
            rows, cols = (int(x) for x in g["shape"])
            raw = base64.b64decode(g["float32_base64"], validate=True)
            w = np.frombuffer(raw, dtype=np.float32).reshape(rows, cols)
            if not np.isfinite(w).all():
                raise HeadsError(f"group {name!r} has weights that are not finite (inf or NaN)")
            if np.abs(w).max(initial=0.0) > HALF_MAX:
                raise HeadsError(f"group {name!r} has weights beyond float16's range")
            groups[name] = GroupHead(
                tuple(g["labels"]), tuple(tuple(float(v) for v in row) for row in w)
            )
        return ReflectionHeads(model_sha256=str(doc["model_sha256"]), groups=groups)
    except HeadsError as exc:
        raise HeadsError(f"{path}: {exc}{_refit(path, HEADS_REFIT)}") from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HeadsError(
            f"{path} is not a reflection heads file ({exc}){_refit(path, HEADS_REFIT)}"
        ) from exc


HEADS_REFIT = "run `selfrag train` to fit them again"
ANSWERABILITY_REFIT = "run `selfrag train --answerability` to fit it again"


def _refit(path: Path, command: str) -> str:
    """What to do about a bad file at `path`: fit it again (or delete it) in a home; the
    package's own copy needs a reinstall."""
    if path.parent == SHIPPED_DIR:
        return "; the file shipped with selfrag is damaged: reinstall selfrag"
    return f"; {command}, or delete the file"


def check_layout(layout: object, error: type[ValueError], retrain: str) -> None:
    """Refuse a file trained at read positions other than the critique's (`READ_LAYOUT`)."""
    if layout != READ_LAYOUT:
        raise error(
            f"trained at the read positions {layout!r} of an earlier selfrag, not "
            f"{READ_LAYOUT!r}; run {retrain} again"
        )


def read_manifest(path: Path) -> dict[str, Any]:
    """The training manifest of a heads or answerability file; ValueError naming the file when
    it is not a JSON object (or nested deeper than such a file is)."""
    doc = _read_json(path)
    if not isinstance(doc, dict):
        raise ValueError(f"{path} is not a JSON object")
    manifest = doc.get("manifest", {})
    return manifest if isinstance(manifest, dict) else {}


def _read_json(path: Path) -> Any:
    """A learned artefact's JSON; deep nesting is a ValueError naming the file, never a
    RecursionError (the files here nest a few levels)."""
    try:
        return load_json(path.read_text(encoding="utf-8"), MAX_JSON_DEPTH)
    except JSONInputError as exc:
        raise ValueError(f"{path}: {exc}") from None


def heads_matrix(heads: ReflectionHeads, group: str) -> np.ndarray:
    """A group's weight rows as a float32 array (labels × hidden)."""
    return np.asarray(heads.groups[group].rows, dtype=np.float32)


# --- answerability models (pipeline.answerability_model)
# ------------------------------------------------


def answerability_path(home: Path, model_sha256: str, source: str) -> Path:
    """Where `selfrag train --answerability` writes the model of a file and critique source."""
    return home / "answerability" / f"{model_sha256}.{source}.json"


def shipped_answerability_path(model_sha256: str, source: str) -> Path:
    return SHIPPED_DIR / f"{model_sha256}.answerability.{source}.json"


def find_answerability(home: Path, model_sha256: str, source: str) -> Path | None:
    """The answerability model of a model file and source: fitted here first, else shipped."""
    return _first_current(
        (
            answerability_path(home, model_sha256, source),
            shipped_answerability_path(model_sha256, source),
        )
    )


def save_answerability(path: Path, model: AnswerabilityModel) -> AnswerabilityModel:
    """Write an answerability model as JSON, atomically, stamped with `READ_LAYOUT` like the
    heads; returns it as read back."""
    doc = model.to_json()
    doc["manifest"] = {**doc.get("manifest", {}), "layout": READ_LAYOUT}
    _write_json(path, doc)
    return load_answerability(path)


def _write_json(path: Path, doc: object) -> None:
    """`doc` as indented JSON at `path`, atomically; readable by all (no secret in it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(doc, indent=1) + "\n").encode(), mode=0o644)


def load_answerability(path: Path) -> AnswerabilityModel:
    """Read an answerability model; a malformed file is an `AnswerabilityError` naming it."""
    try:
        doc = _read_json(path)
        check_layout(
            doc.get("manifest", {}).get("layout"),
            AnswerabilityError,
            "`selfrag train --answerability`",
        )
        return AnswerabilityModel.from_json(doc)
    except AnswerabilityError as exc:
        raise AnswerabilityError(f"{path}: {exc}{_refit(path, ANSWERABILITY_REFIT)}") from exc
    except (OSError, ValueError, AttributeError) as exc:
        raise AnswerabilityError(
            f"{path} is not an answerability model ({exc}){_refit(path, ANSWERABILITY_REFIT)}"
        ) from exc
