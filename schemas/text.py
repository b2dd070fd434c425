"""What counts as visible text, and text made safe for a terminal.

Text from a corpus or a model can carry characters a terminal obeys instead of showing: C0 and
C1 controls (ESC starts the sequences that retitle a window, clear the screen or plant an OSC 8
link; a carriage return lets the next text overwrite a line) and the bidirectional overrides
that reorder what is shown. Zero-width and format characters show nothing at all, and neither
does a whole escape sequence (ECMA-48: `ESC [2J` clears the screen; its `[2J` is not text).
"""

from __future__ import annotations

import re
import unicodedata

# Unicode's bidirectional embeddings, overrides and isolates, and the marks that steer them.
_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
# Every C0 control but tab and newline, DEL, every C1 control, and the bidi controls.
_TERMINAL_UNSAFE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")
# ECMA-48 sequences, 7- and 8-bit: a control string (OSC, DCS, SOS, PM, APC) up to its ST or
# BEL (or the end: one left open swallows the rest), a CSI with its parameters, and the
# two-character escapes (charset, keypad, reset).
_ESCAPE_SEQUENCE = re.compile(
    r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c|\Z)"
    r"|(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"
    r"|\x1b[\x20-\x2f]*[\x30-\x7e]?"
)
# Categories that show nothing: controls, format (zero-width) characters, separators (spaces).
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})
# An HTML tag (or what a browser would take for one).
_TAG = re.compile(r"<[^<>]*>")
# Fillers that render blank though Unicode classes them as letters or symbols.
_BLANK_FILLERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def terminal_safe(text: str) -> str:
    """`text` without the characters a terminal would act on rather than show (tab and
    newline stay)."""
    return _TERMINAL_UNSAFE.sub("", text)


def has_visible_text(text: str) -> bool:
    """Whether `text` shows anything: not only whitespace, control, zero-width or other
    format characters and terminal escape sequences."""
    return any(
        unicodedata.category(ch) not in _INVISIBLE_CATEGORIES and ch not in _BLANK_FILLERS
        for ch in _ESCAPE_SEQUENCE.sub("", text)
    )


def plain_title(text: str) -> str:
    """A title as plain text for a client that may render it as HTML or print it: tags and
    terminal control characters dropped, whitespace runs one space, a stray `<` or `>`
    escaped."""
    plain = " ".join(terminal_safe(_TAG.sub(" ", text)).split())
    return plain.replace("<", "&lt;").replace(">", "&gt;")
