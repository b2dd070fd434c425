"""`selfrag docs list` and `selfrag docs rm ID|PATH…`: the indexed documents."""

from __future__ import annotations

import argparse
import json
import unicodedata
from pathlib import Path

from selfrag.cli.common import EXIT_PARTIAL, CLIError, settings_from_args
from selfrag.cli.remote import open_home
from selfrag.schemas.documents import DocumentInfo


def cmd_docs(args: argparse.Namespace) -> int:
    """List or remove documents of the home's collection: in this process, or through the
    server that holds its store once it says it serves them (`cli.remote.open_home`)."""
    settings = settings_from_args(args)
    if args.docs_command == "rm" and not args.refs:
        raise CLIError("name at least one document id or path to remove")
    with open_home(settings) as rag:
        if args.docs_command == "list":
            docs = rag.documents()
            if args.json:
                print(json.dumps([d.model_dump(mode="json") for d in docs], indent=2))
            else:
                print(render_documents(docs))
            return 0
        refs = list(args.refs)
        if rag.url is not None:  # the server's working folder is not this one
            refs = [str(Path(r).resolve()) if Path(r).exists() else r for r in refs]
        removal = rag.remove(*refs)
    if args.json:
        print(removal.model_dump_json(indent=2))
    else:
        print(
            f"removed {len(removal.documents)} documents, {removal.passages} passages "
            f"from {settings.home}"
        )
        for ref, shown_ref in zip(refs, args.refs, strict=True):
            if ref in removal.unmatched:
                print(
                    f"no indexed document is {shown(shown_ref)} "
                    "(an id, or a file or folder indexed)"
                )
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
