"""`selfrag docs list` and `selfrag docs rm ID|PATH…`: the indexed documents."""

from __future__ import annotations

import argparse
import json
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING

from selfrag.cli.common import EXIT_PARTIAL, CLIError, settings_from_args
from selfrag.cli.remote import held_store, via_server
from selfrag.schemas.documents import DocumentInfo, Removal

if TYPE_CHECKING:
    from selfrag.infra.store.qdrant_store import StoreHeld
    from selfrag.schemas.settings import Settings


def cmd_docs(args: argparse.Namespace) -> int:
    from selfrag.api import SelfRAG

    settings = settings_from_args(args)
    with SelfRAG(settings) as rag:
        held = held_store(rag)  # a server holds the store: go through it
        if args.docs_command == "list":
            if held is not None:
                found = via_server(settings, held, "GET", "/v1/documents")
                docs = [DocumentInfo.model_validate(d) for d in found]
            else:
                docs = rag.documents()
            if args.json:
                print(json.dumps([d.model_dump(mode="json") for d in docs], indent=2))
            else:
                print(render_documents(docs))
            return 0
        if not args.refs:
            raise CLIError("name at least one document id or path to remove")
        if held is not None:
            removal = _remove_via_server(settings, held, args.refs)
        else:
            removal = rag.remove(*args.refs)
    if args.json:
        print(removal.model_dump_json(indent=2))
    else:
        print(
            f"removed {len(removal.documents)} documents, {removal.passages} passages "
            f"from {settings.home}"
        )
        for ref in removal.unmatched:
            print(f"no indexed document is {shown(ref)} (an id, or a file or folder indexed)")
    return EXIT_PARTIAL if removal.unmatched else 0


def _remove_via_server(settings: Settings, held: StoreHeld, refs: list[str]) -> Removal:
    """One DELETE per ref; a ref the server names no document for is reported unmatched."""
    from urllib.parse import quote

    ids: list[str] = []
    passages = 0
    unmatched: list[str] = []
    for ref in refs:
        path = str(Path(ref).resolve()) if Path(ref).exists() else ref
        try:
            done = via_server(settings, held, "DELETE", "/v1/documents/" + quote(path, safe=""))
        except CLIError as exc:
            if " answered 404" not in str(exc):
                raise
            unmatched.append(ref)
            continue
        removal = Removal.model_validate(done)
        ids += removal.documents
        passages += removal.passages
    return Removal(documents=ids, passages=passages, unmatched=unmatched)


def render_documents(docs: list[DocumentInfo]) -> str:
    """One line a document: id, passages, indexed at, title, source; and a last line saying so
    when a control character of one was shown as U+FFFD."""
    if not docs:
        return "no documents indexed"
    width = min(max(len(shown(d.id)) for d in docs), 48)
    lines = [f"{'id':<{width}} {'passages':>8}  {'indexed at':<25} title — source"]
    replaced = False
    for d in docs:
        fields = (d.id, d.title or "", d.source or d.url or "")
        ident, title, source = (shown(f) for f in fields)
        replaced = replaced or (ident, title, source) != tuple(f.replace("\n", " ") for f in fields)
        lines.append(
            f"{ident:<{width}} {d.passages:>8}  {d.indexed_at or '':<25} {title} — {source}"
        )
    lines.append(f"{len(docs)} documents, {sum(d.passages for d in docs)} passages")
    if replaced:
        lines.append(
            "\ufffd stands for a control or format character (an escape, a tab, a bidirectional "
            "override) not printed; the stored text is unchanged: `docs list --json` gives it"
        )
    return "\n".join(lines)


def shown(text: str) -> str:
    """`text` from a corpus, safe to print: control and format characters (terminal escapes,
    bidirectional overrides) become U+FFFD."""
    return "".join(
        "\ufffd" if unicodedata.category(c) in ("Cc", "Cf") else c for c in text.replace("\n", " ")
    )
