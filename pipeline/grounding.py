"""Whether a segment's content is found in its evidence: its numbers, names and identifiers,
and its words in one sentence.

A drafted segment copies its facts from the passage it was drafted on (its title and text, as
the prompt shows it). A number or a name the segment states that the passage lacks was not
copied from anything shown: the model made it up, brought it from memory, or repeated a name of
the question that the passage does not hold (a question about Illinois over a passage about
Indiana), and the citation does not back it. A segment that a passage supports also says what
one of its sentences says, while one put together from words scattered over the passage, or
from the question's words that no sentence holds with the answer, does not (`sentence_share`;
such a word of the question counts half).
Both checks are exact and cost one pass over the passage's words (no model call).
"""

from __future__ import annotations

import itertools
import re
import unicodedata

GROUNDING_RULE = (
    "terms(whole names or their plurals, identifiers; in the passage only)"
    "*sentence(question words half)"
)
"""Names what `grounding_score` computes, for the identities of reads and thresholds made
with it (a changed rule reads differently)."""
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[^\W\d_][\w'’-]*", re.UNICODE)
# A run of the characters identifiers, paths and flags are written with (`_identifier`).
_CODE_RUN = re.compile(r"[\w./=-]+")
# Capitalised words that start clauses or are titles, not names of things a passage states.
_NOT_NAMES = frozenset(
    """a an the this that these those it its he she they we you i his her their our my your
    in on at of for from by with to and or but if when while where what which who whom whose
    why how yes no not there here as so after before during since until about between
    january february march april may june july august september october november december
    monday tuesday wednesday thursday friday saturday sunday""".split()
)
# Words that carry no content of their own, left out of `sentence_share` (with every word of
# fewer than three letters).
_FUNCTION_WORDS = _NOT_NAMES | frozenset(
    """is was were are be been being did does do has have had many much than into also
    him them one""".split()
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
# Scripts written without spaces between words (Chinese, Japanese, Thai, Lao, Myanmar, Khmer):
# `\w+` finds runs of many words there, whose shares mean nothing.
_UNSPACED = re.compile(
    "[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]"
)


def _fold(text: str) -> str:
    """Lowercased, accents and curly quotes folded, so "Zürich" matches "Zurich"."""
    decomposed = unicodedata.normalize("NFKD", text.replace("’", "'"))
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold()


def _number_forms(text: str) -> set[str]:
    """The numbers of `text`, without thousands separators ("1,200" and "1200" are one)."""
    out = set()
    for m in _NUMBER.finditer(text):
        raw = m.group(0)
        out.add(raw.replace(",", ""))
    return out


def _identifier(run: str) -> bool:
    """Whether `run` is written as code is: a flag (`--top-k`), a name with an underscore
    (`retry_drafts`), a setting (`selfrag-index=true`), a dotted name (`config.toml`) or a path
    (`/healthz`, `bench/data/`); not a number, a version ("Qwen2.5"), an abbreviation ("e.g",
    "U.S") or two words joined by one slash ("and/or")."""
    if not any(c.isalpha() for c in run):
        return False
    if run.startswith("--"):
        return run[2:3].isalpha()
    name, _, value = run.partition("=")
    if (name and value) or "_" in run.strip("_"):
        return True
    pieces = run.split(".")
    if any(len(a) > 1 and len(b) > 1 and b[0].isalpha() for a, b in itertools.pairwise(pieces)):
        return True
    return run.count("/") > 1 or (run.startswith("/") and run[1:2].isalpha())


def key_terms(segment: str) -> list[str]:
    """The numbers, names and identifiers `segment` states, in order: numbers; capitalised
    words other than the first word of a sentence (unless it is in capitals inside) and common
    function words; and words written as code (`_identifier`)."""
    terms: list[str] = []
    for m in _NUMBER.finditer(segment):
        terms.append(m.group(0))
    for m in _WORD.finditer(segment):
        word = m.group(0).strip("'’-")
        if len(word) < 2 or not word[0].isupper():
            continue
        before = segment[: m.start()].rstrip()
        starts_sentence = not before or before[-1] in '.!?:;"“(['
        if (starts_sentence and not word[1:].isupper()) or _fold(word) in _NOT_NAMES:
            continue
        terms.append(word)
    for m in _CODE_RUN.finditer(segment):
        run = m.group(0).rstrip(".=-").lstrip(".")
        if _identifier(run):
            terms.append(run)
    return list(dict.fromkeys(terms))


def missing_terms(segment: str, evidence: str) -> list[str]:
    """The key terms of `segment` (`key_terms`) that `evidence` lacks: content the citation
    does not back, whether the model invented it or repeated it from the question. Empty when
    everything is found (or nothing is key)."""
    return _missing(key_terms(segment), evidence)


def _missing(terms: list[str], evidence: str) -> list[str]:
    """The `terms` that `evidence` lacks (`missing_terms`)."""
    seen = _fold(evidence)
    seen_numbers = _number_forms(seen)
    out = []
    for term in terms:
        if _NUMBER.fullmatch(term):
            if term.replace(",", "") not in seen_numbers:
                out.append(term)
            continue
        name = _fold(term)
        if not (_holds(seen, name) or _holds(seen, name.split("'")[0])):
            out.append(term)
    return out


def _holds(text: str, name: str) -> bool:
    """Whether folded `text` has `name` (a word, or words joined by hyphens or apostrophes)
    as a whole or in its plural ("Norman" in "the Normans"), not inside a longer word."""
    return re.search(rf"(?<!\w){re.escape(name)}(?:e?s)?(?!\w)", text) is not None


def sentence_share(segment: str, evidence: str, question: str = "") -> float | None:
    """The largest share of `segment`'s content words (words of three letters or more, other
    than function words; folded) that one sentence (or line) of `evidence` holds, where a word
    of `question` that the sentence lacks counts half (restating the question is not evidence,
    and not an invention either); None when the segment has no content word, or is written in
    a script without spaces between words."""
    words = _countable_words(segment)
    if words is None:
        return None
    asked = _content_words(question)
    best = 0.0
    for sentence in _SENTENCE_END.split(evidence):
        held = words & _content_words(sentence)
        best = max(best, (len(held) + 0.5 * len((words - held) & asked)) / len(words))
    return best


def word_share(segment: str, evidence: str) -> float | None:
    """The share of `segment`'s content words (as `sentence_share` counts them) that occur
    anywhere in `evidence`; None when the segment has no content word, or is written in a
    script without spaces between words."""
    words = _countable_words(segment)
    if words is None:
        return None
    return len(words & _content_words(evidence)) / len(words)


def _countable_words(segment: str) -> set[str] | None:
    """`segment`'s content words, or None when it has none or is written in a script without
    spaces between words (whose words cannot be counted so)."""
    words = _content_words(segment)
    return None if not words or _UNSPACED.search(segment) else words


def _content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"\w+", _fold(text)) if len(w) > 2 and w not in _FUNCTION_WORDS}


def term_share(segment: str, evidence: str) -> float | None:
    """The fraction of `segment`'s key terms that `evidence` holds (`missing_terms`); None
    when it states none."""
    terms = key_terms(segment)
    if not terms:
        return None
    return 1.0 - len(_missing(terms, evidence)) / len(terms)


def grounding_score(segment: str, evidence: str, question: str = "") -> float | None:
    """`term_share` times `sentence_share` (either alone when the other is None); None when
    the segment has neither a key term nor a content word."""
    found = term_share(segment, evidence)
    share = sentence_share(segment, evidence, question)
    if found is None or share is None:
        return share if found is None else found
    return found * share


def new_words(segment: str, said: str) -> frozenset[str]:
    """`segment`'s content words (as `novelty` counts them) that `said` lacks."""
    return frozenset((_countable_words(segment) or set()) - _content_words(said))


def content_words(text: str) -> frozenset[str]:
    """The words of `text` that `novelty` and `word_share` count: no function word, none
    under three letters, case folded."""
    return frozenset(_content_words(text))


def novelty(segment: str, said: str) -> float | None:
    """The share of `segment`'s content words (as `sentence_share` counts them) that `said`
    (the question and the answer so far) lacks: 0 for a segment that only restates them; None
    when the segment has no content word, or is written in a script without spaces."""
    words = _countable_words(segment)
    if words is None:
        return None
    return len(words - _content_words(said)) / len(words)
