"""Which process holds an embedded store's folder: recorded by the holder after it locks, read
for the message another process gets when its open is refused."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from selfrag.infra.file_lock import write_atomic
from selfrag.infra.store.qdrant_engine import StoreHeld

log = logging.getLogger("selfrag.store")


HOLDER_FILE = "holder.json"
"""Who holds the folder's lock: pid and command, written by the holder after it locks."""


def record_holder(folder: Path) -> None:
    """Say in the folder which process holds it (for the message another process gets)."""
    holder = {"pid": os.getpid(), "command": " ".join(sys.argv)[:500]}
    try:
        write_atomic(folder / HOLDER_FILE, json.dumps(holder).encode(), mode=0o644)
    except OSError as error:  # only a message depends on it
        log.debug("cannot record the holder of %s: %s", folder, error)


def holder_of(folder: Path) -> str | None:
    """`pid N (command)` of the process holding `folder`, when it is alive and known: its
    process title as the system shows it (a Ray worker's names its actor), else the command
    it recorded."""
    try:
        data = json.loads((folder / HOLDER_FILE).read_text(encoding="utf-8"))
        pid = int(data["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    command = str(data.get("command") or "")
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
        command = title.decode("utf-8", "replace") or command
    except OSError:
        pass
    if pid == os.getpid():
        return f"this process (pid {pid}), in another store"
    return f"pid {pid} ({command[:200]})"


def held_error(folder: Path) -> StoreHeld:
    """The error of an open refused because another process holds `folder`, naming it."""
    holder = holder_of(folder)
    who = f" by {holder}" if holder else ""
    return StoreHeld(
        f"the embedded Qdrant store {folder} is held{who}: one process at a time opens it. "
        "Stop that process, or, when it is `selfrag serve`, ask through its HTTP API "
        "(`selfrag ask` and `selfrag docs` do when serve.host/serve.port reach it); for several "
        "processes at once, use a Qdrant server (retrieval.qdrant_url)",
        holder,
    )
