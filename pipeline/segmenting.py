"""Where a drafted segment ends: at the end of a sentence."""

from __future__ import annotations

import re

# A sentence ends at . ! ? (optionally closed by a quote or bracket) or a line break, but not
# inside a number ("3.5"), an initial ("J. S. Bach") or a common abbreviation.
_END = re.compile(r"""(?:[.!?]["'”’)\]]*|\n)\s*$""")
_ABBREVIATIONS = frozenset(
    {
        "mr",
        "mrs",
        "ms",
        "dr",
        "st",
        "vs",
        "etc",
        "e.g",
        "i.e",
        "no",
        "jr",
        "sr",
        "prof",
        "inc",
        "co",
    }
)
MIN_SEGMENT_CHARS = 12


def ends_sentence(text: str) -> bool:
    """True when `text` ends a sentence and is long enough to stand as a segment."""
    stripped = text.rstrip()
    if len(stripped) < MIN_SEGMENT_CHARS:
        return False
    if text.endswith("\n") and stripped:
        return True
    if not _END.search(stripped):
        return False
    body = stripped.rstrip("\"'”’)]")
    if not body.endswith("."):
        return True
    last_word = body[:-1].rsplit(maxsplit=1)[-1] if body[:-1].split() else ""
    if len(last_word) == 1 and last_word.isalpha():
        return False
    if last_word.lower().rstrip(".") in _ABBREVIATIONS:
        return False
    return not (last_word.isdigit() and len(last_word) <= 2)
