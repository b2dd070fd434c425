"""The evidence span of a cited segment: the sentence of its passage that best supports it.

A segment is drafted from its passage, and what it says it mostly copies from one sentence of
it (a name, a year, a phrase). So the span is the passage sentence that shares the most of the
segment's content words, each shared word weighted by 1 / (how many of the passage's sentences
contain it): the passage's topic word, in every sentence, decides nothing, while a year found
in one sentence points at it. Ties go to the earlier sentence; a segment that shares no content
word with the passage has no span. It is deterministic and costs one pass over the passage's
words, cheap enough to run for every drafted branch (no model call, unlike embedding every
sentence), so every cited segment carries its span wherever it is shown.
"""

from __future__ import annotations

import re
from fractions import Fraction

from selfrag.pipeline.segmenting import sentence_spans
from selfrag.schemas.answer import Evidence

_WORD = re.compile(r"\w+")
# Words that say nothing about which sentence a segment came from.
_STOPWORDS = frozenset(
    """a an and are as at be been but by for from had has have he her his in is it its of on
    or she that the their them they this to was were which who with""".split()
)


def content_words(text: str) -> set[str]:
    """The lowercased words of `text` that can tie it to a sentence: no stopwords, and no
    one-letter words except digits."""
    return {
        w
        for w in _WORD.findall(text.lower())
        if w not in _STOPWORDS and (len(w) > 1 or w.isdigit())
    }


def evidence_span(passage: str, segment: str) -> Evidence | None:
    """The sentence of `passage` that best supports `segment` (see the module docstring), or
    None when they share no content word."""
    wanted = content_words(segment)
    if not wanted:
        return None
    spans = sentence_spans(passage)
    shared = [wanted & content_words(passage[start:end]) for start, end in spans]
    found_in: dict[str, int] = {}
    for words in shared:
        for w in words:
            found_in[w] = found_in.get(w, 0) + 1
    best, best_score = None, Fraction(0)
    for span, words in zip(spans, shared, strict=True):
        # Exact: equal scores are a tie (the earlier sentence), whatever the set's order.
        score = sum((Fraction(1, found_in[w]) for w in words), Fraction(0))
        if score > best_score:
            best, best_score = span, score
    if best is None:
        return None
    start, end = best
    return Evidence(start=start, end=end, text=passage[start:end])
