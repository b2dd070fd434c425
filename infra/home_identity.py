"""A home's identity: a random id written once in the home (`HOME/home_id`), by which a command
that names a home tells whether a running server serves that one (`schemas.health.ServedIndex`).
A path cannot serve: the same folder has many names, and a server does not show its paths."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

HOME_ID_FILE = "home_id"
_HOME_ID = re.compile(r"[0-9a-f]{32}")


class HomeIdError(ValueError):
    """The home's id file holds something else than an id."""


def home_id(home: Path) -> str:
    """The id of the home `home`, written now (atomically: every process that races to write
    the first one reads the same) if it has none yet."""
    path = home / HOME_ID_FILE
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    home.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{HOME_ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    draft.write_text(secrets.token_hex(16) + "\n")
    try:
        os.link(draft, path)  # fails when another process wrote one first: that one counts
    except FileExistsError:
        pass
    finally:
        draft.unlink()
    return _read(path)


def _read(path: Path) -> str:
    text = path.read_text().strip()
    if not _HOME_ID.fullmatch(text):
        raise HomeIdError(
            f"{path} does not hold a home id (32 hexadecimal digits); delete it and a new one "
            "is written"
        )
    return text
