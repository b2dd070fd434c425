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


# Between sentences of a passage: whitespace after . ! ? before what can start a sentence.
_BETWEEN_SENTENCES = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """The sentences of a passage as (start, end) offsets into `text`, surrounding whitespace
    left out; what training examples (`pipeline/learning/reflection_data.py`) and evidence spans
    (`pipeline/evidence.py`) both split passages with."""
    spans = []
    start = 0
    for gap in (*_BETWEEN_SENTENCES.finditer(text), None):
        end = len(text) if gap is None else gap.start()
        piece = text[start:end]
        left = start + len(piece) - len(piece.lstrip())
        right = start + len(piece.rstrip())
        if right > left:
            spans.append((left, right))
        if gap is not None:
            start = gap.end()
    return spans
