"""The index's documents, read from its passages' payloads: the listing `selfrag docs` shows,
and which documents a removal or a re-indexed folder means."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from selfrag.schemas.documents import DocumentInfo

DIGEST = "doc_digest"
"""The passage metadata (and payload) key of its document's digest (`DocumentInfo.digest`)."""


def documents_of(payloads: Iterable[dict[str, Any]]) -> list[DocumentInfo]:
    """One entry per `doc_id`, sorted by source then id; the latest `indexed_at` of its
    passages."""
    found: dict[str, dict[str, Any]] = {}
    for payload in payloads:
        doc = str(payload.get("doc_id") or payload.get("passage_id") or "")
        entry = found.get(doc)
        if entry is None:
            found[doc] = entry = {
                "id": doc,
                "source": _text(payload.get("source")),
                "title": _text(payload.get("doc_title")) or _text(payload.get("title")),
                "url": _text(payload.get("url")),
                "passages": 0,
                "indexed_at": _text(payload.get("indexed_at")),
                "digest": _text(payload.get(DIGEST)),
            }
        entry["passages"] += 1
        if entry["digest"] != _text(payload.get(DIGEST)):
            entry["digest"] = None  # passages of two readings: not one document as indexed
        when = _text(payload.get("indexed_at"))
        if when and (entry["indexed_at"] is None or when > entry["indexed_at"]):
            entry["indexed_at"] = when
    infos = [DocumentInfo.model_validate(entry) for entry in found.values()]
    return sorted(infos, key=lambda d: (d.source or "", d.id))


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def under(source: str | None, root: str) -> bool:
    """Whether a document read from `source` comes from the file or folder `root`."""
    if not source:
        return False
    return source == root or source.startswith(root.rstrip(os.sep) + os.sep)


def stale(
    documents: Sequence[DocumentInfo], root: str, seen: Collection[str], keep: Collection[str]
) -> list[str]:
    """Ids of the documents read from `root` before that a new read of it did not find
    (`seen`), except those of the files in `keep` (which failed to read this time)."""
    return [
        d.id
        for d in documents
        if under(d.source, root) and d.id not in seen and d.source not in keep
    ]


def matching(documents: Sequence[DocumentInfo], refs: Sequence[str]) -> tuple[list[str], list[str]]:
    """The ids of the documents `refs` name, and the refs that name none. A ref is a document
    id, or a path: the file a document was read from, or a folder holding such files (as it
    is given, or resolved from the working folder)."""
    ids = {d.id for d in documents}
    chosen: dict[str, None] = {}
    unmatched: list[str] = []
    for ref in refs:
        hits = [ref] if ref in ids else []
        if not hits:
            roots = {ref, str(Path(ref).expanduser().absolute())}
            try:
                roots.add(str(Path(ref).expanduser().resolve()))
            except (OSError, RuntimeError):
                pass
            hits = [d.id for d in documents if any(under(d.source, r) for r in roots)]
        if hits:
            chosen.update(dict.fromkeys(hits))
        else:
            unmatched.append(ref)
    return list(chosen), unmatched
