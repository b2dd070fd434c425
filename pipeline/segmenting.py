"""Where a drafted segment ends (at the end of a sentence), and the drafts that say nothing: an
echo of the question, a loop."""

from __future__ import annotations

import re

# A sentence ends at . ! ? (optionally closed by a quote or bracket) or a line break, but not
# inside a number ("3.5"), an initial ("J. S. Bach"), a common abbreviation or inline code
# ("`model." goes on as "omp_wait_policy`": a dotted name is one word).
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
    if not _END.search(stripped) or stripped.count("`") % 2:
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


def restates_question(segment: str, question: str) -> bool:
    """Whether a drafted `segment` only repeats `question`, with or without a "Question:"
    label: a small model echoing its prompt, which answers nothing (its answer tends to come
    after the echo)."""
    said, asked = _words(segment), _words(question)
    if said[:1] == ["question"] and asked[:1] != ["question"]:
        said = said[1:]
    return bool(asked) and said == asked


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.casefold())


# A stretch of text repeated back to back this many times, over at least this many characters,
# is a model stuck on a phrase: no sentence says the same thing three times running.
LOOP_REPEATS = 3
LOOP_MIN_CHARS = 20
# The longest stretch looked for: a longer one is rarely what a model loops on, and the check
# stays linear in the draft's length.
LOOP_MAX_PERIOD = 48


def loops(text: str) -> bool:
    """Whether `text` holds a loop: a stretch (of one character or more) repeated back to back
    at least `LOOP_REPEATS` times over at least `LOOP_MIN_CHARS` characters ("port 80, port
    80, port 80, ", "SERVE-SERVE-SERVE-SERVE", "100000000000000000000")."""
    n = len(text)
    for period in range(1, min(n // LOOP_REPEATS, LOOP_MAX_PERIOD) + 1):
        run = 0
        for i in range(period, n):
            run = run + 1 if text[i] == text[i - period] else 0
            if run + period >= max(LOOP_REPEATS * period, LOOP_MIN_CHARS):
                return True
    return False
