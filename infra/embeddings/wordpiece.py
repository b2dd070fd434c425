"""BERT's WordPiece tokenizer, as Hugging Face's `BertTokenizerFast` runs it (BertNormalizer,
BertPreTokenizer, WordPiece), for the embedder.

llama.cpp's own `bert` tokenizer gives the same ids on English text but drops every combining
mark, spacing ones (Unicode Mc: the vowel signs of Devanagari and other Indic scripts) included,
where Hugging Face strips only the non-spacing ones (Mn) and keeps the rest as word pieces; on
the sample corpus that changed three passages' ids and one vector to cosine 0.993
(notes/benchmarks.md). So the embedder tokenizes here and gives llama.cpp the ids.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

_CUT = re.compile(r"[ \t\n\r]")
MAX_WORD_CHARS = 100
"""A longer word is one [UNK] (Hugging Face's `max_input_chars_per_word`)."""
# Code point ranges Hugging Face surrounds with spaces (the CJK Unified Ideographs blocks).
_CJK = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


class WordPiece:
    """Greedy longest-match-first WordPiece over a vocabulary (`vocab.txt`'s lines, in id
    order), with BERT's normalisation: control characters dropped, whitespace made a space, CJK
    ideographs split apart, accents stripped (NFD, then the Mn marks removed) and lower case
    when asked, then words split at whitespace and punctuation. A special token written in the
    text ("[SEP]") is that token, as in Hugging Face."""

    def __init__(
        self,
        vocab: Sequence[str],
        *,
        lowercase: bool,
        strip_accents: bool,
        specials: Sequence[str],
        unk: str = "[UNK]",
    ) -> None:
        self._ids = {piece: i for i, piece in enumerate(vocab)}
        self._unk = self._ids[unk]
        self._lowercase = lowercase
        self._strip_accents = strip_accents
        self._longest = max(map(len, vocab))
        self._specials = re.compile("(" + "|".join(map(re.escape, specials)) + ")")

    def ids(self, text: str, limit: int | None = None) -> list[int]:
        """The word-piece ids of `text`, without [CLS] and [SEP] around it; with `limit`, the
        first `limit` of them, reading only as much of the text as they take."""
        out: list[int] = []
        for chunk in _chunks(text) if limit is not None else (text,):
            for i, part in enumerate(self._specials.split(chunk)):
                if i % 2:  # a special token's own text
                    out.append(self._ids[part])
                    continue
                for word in self.words(part):
                    out += self._word_ids(word)
            if limit is not None and len(out) >= limit:
                return out[:limit]
        return out

    def words(self, text: str) -> list[str]:
        """`text` normalised and split into words and single punctuation marks."""
        chars = []
        for c in text:
            # Controls first: a vertical tab or a form feed is dropped, not a space.
            if c in "\t\n\r" or (c.isspace() and unicodedata.category(c)[0] != "C"):
                chars.append(" ")
            elif c in "\x00\ufffd" or unicodedata.category(c)[0] == "C":
                continue
            elif _is_cjk(ord(c)):
                chars.append(f" {c} ")
            else:
                chars.append(c)
        norm = "".join(chars)
        if self._strip_accents:
            norm = "".join(
                c for c in unicodedata.normalize("NFD", norm) if unicodedata.category(c) != "Mn"
            )
        if self._lowercase:
            norm = norm.lower()
        words: list[str] = []
        for chunk in norm.split():
            start = 0
            for i, c in enumerate(chunk):
                if _is_punctuation(c):
                    if i > start:
                        words.append(chunk[start:i])
                    words.append(c)
                    start = i + 1
            if start < len(chunk):
                words.append(chunk[start:])
        return words

    def _word_ids(self, word: str) -> list[int]:
        if len(word) > MAX_WORD_CHARS:
            return [self._unk]
        pieces: list[int] = []
        start = 0
        while start < len(word):
            end = min(len(word), start + self._longest)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                found = self._ids.get(piece)
                if found is not None:
                    pieces.append(found)
                    break
                end -= 1
            if end == start:
                return [self._unk]  # one part matches nothing: the whole word is unknown
            start = end
        return pieces


def _chunks(text: str, size: int = 2048) -> list[str]:
    """`text` in pieces of about `size` characters, cut only just after a space, tab or line
    break (which always ends a word; no special token holds one), so each tokenizes as it would
    in place. Other Unicode spaces are not cut at: some are controls BERT drops."""
    cuts = [0]
    while len(text) - cuts[-1] > size:
        space = _CUT.search(text, cuts[-1] + size)
        if space is None:
            break
        cuts.append(space.end())
    return [text[a:b] for a, b in zip(cuts, [*cuts[1:], len(text)], strict=True)]


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK)


def _is_punctuation(c: str) -> bool:
    # Hugging Face counts every ASCII non-alphanumeric printable as punctuation ("$", "+",
    # "^", "`" are symbols to Unicode), and every Unicode P* character.
    cp = ord(c)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(c).startswith("P")
