"""`selfrag docs list` and `selfrag docs rm ID|PATH…`: the indexed documents."""

from __future__ import annotations

import argparse
import json
import unicodedata

from selfrag.cli.common import EXIT_PARTIAL, CLIError, settings_from_args
from selfrag.schemas.documents import DocumentInfo


def cmd_docs(args: argparse.Namespace) -> int:
    from selfrag.api import SelfRAG

    settings = settings_from_args(args)
    with SelfRAG(settings) as rag:
        if args.docs_command == "list":
            docs = rag.documents()
            if args.json:
                print(json.dumps([d.model_dump(mode="json") for d in docs], indent=2))
            else:
                print(render_documents(docs))
            return 0
        if not args.refs:
            raise CLIError("name at least one document id or path to remove")
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


def render_documents(docs: list[DocumentInfo]) -> str:
    """One line a document: id, passages, indexed at, title, source."""
    if not docs:
        return "no documents indexed"
    width = min(max(len(shown(d.id)) for d in docs), 48)
    lines = [f"{'id':<{width}} {'passages':>8}  {'indexed at':<25} title — source"]
    for d in docs:
        title = shown(d.title or "")
        source = shown(d.source or d.url or "")
        lines.append(
            f"{shown(d.id):<{width}} {d.passages:>8}  {d.indexed_at or '':<25} {title} — {source}"
        )
    lines.append(f"{len(docs)} documents, {sum(d.passages for d in docs)} passages")
    return "\n".join(lines)


def shown(text: str) -> str:
    """`text` from a corpus, safe to print: control and format characters (terminal escapes,
    bidirectional overrides) become U+FFFD."""
    return "".join(
        "\ufffd" if unicodedata.category(c) in ("Cc", "Cf") else c for c in text.replace("\n", " ")
    )
