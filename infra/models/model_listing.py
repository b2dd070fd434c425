"""What `selfrag models` lists: each preset and `model.path`, installed or not, with the file
the engine would load, its size and SHA-256 and its reflection heads, without loading, joining
or converting anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from selfrag.infra.models import model_presets
from selfrag.infra.models.heads_store import find_heads
from selfrag.infra.models.model_files import (
    AUTO_FORMAT,
    derived_format,
    derived_path,
    file_sha256,
    gguf_file_type,
)
from selfrag.infra.models.model_presets import (
    ModelPreset,
    joined_path,
    missing_parts,
    model_title,
    part_path,
    preset_file,
    resolve_model,
)
from selfrag.schemas.settings import ModelSettings


def list_models(settings: ModelSettings, home: Path) -> list[dict[str, Any]]:
    """One row per preset, and one for `model.path` when set: whether it is installed, the
    file the engine would load (derived as `model.weights` says, once per home), its size and
    SHA-256, the reflection heads trained or shipped for that file (`model.heads` for the
    configured model), and whether it is the configured model. A split preset not joined yet
    is listed by its pinned hash, without joining it, when that file is what the engine loads."""
    rows = []
    for p in model_presets.PRESETS.values():
        active = settings.path is None and settings.preset == p.name
        row: dict[str, Any] = {
            "name": p.name,
            "title": p.title,
            "active": active,
            "license": p.license,
            "license_note": p.license_note,
            "file_type": p.file_type,
        }
        missing = missing_parts(p)
        if missing:
            row.update(installed=False, missing=[m.requirement for m in missing])
            row["install"] = p.install_command
        elif p.split and not joined_path(p, home).is_file() and _loads_as_is(p, settings):
            heads = _heads_of(p.sha256, settings, home, active)
            row.update(installed=True, path=None, size=p.size, sha256=p.sha256, heads=heads)
            row["joins_to"] = str(joined_path(p, home))
        else:
            row.update(installed=True, **_loaded(preset_file(p, home), settings, home, active))
        rows.append(row)
    if settings.path is not None:
        path = resolve_model(settings, home)
        row = {"name": "model.path", "title": model_title(settings), "active": True}
        row.update(installed=True, **_loaded(path, settings, home, True))
        rows.append(row)
    return rows


def _loads_as_is(p: ModelPreset, settings: ModelSettings) -> bool:
    """Whether the engine loads the preset's file itself (no derived copy) under
    `model.weights`; the file type is read from the first part, which holds the header."""
    if settings.weights == "original":
        return True
    first = part_path(p.parts[0])
    ftype = gguf_file_type(first) if first is not None else None
    return settings.weights == "auto" and ftype is not None and ftype not in AUTO_FORMAT


def _heads_of(sha: str, settings: ModelSettings, home: Path, active: bool) -> str | None:
    heads = settings.heads if active and settings.heads is not None else find_heads(home, sha)
    return str(heads) if heads is not None else None


def _loaded(source: Path, settings: ModelSettings, home: Path, active: bool) -> dict[str, Any]:
    """The row of the file the engine loads from `source`. A derived copy not made yet is not
    made here (a conversion costs time and disk): it is listed as `derives_to`, with its
    source's size and hash, and heads None (the copy's own hash names its heads)."""
    fmt = derived_format(source, settings.weights)
    path = source if fmt is None else derived_path(source, fmt, home)
    if not path.is_file():
        return {
            "path": None,
            "derives_to": str(path),
            "derived_from": str(source),
            "size": source.stat().st_size,
            "sha256": file_sha256(source),
            "heads": str(settings.heads) if active and settings.heads is not None else None,
        }
    sha = file_sha256(path)
    return {
        "path": str(path),
        "size": path.stat().st_size,
        "sha256": sha,
        "heads": _heads_of(sha, settings, home, active),
    }
