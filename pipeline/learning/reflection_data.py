"""Training examples for the reflection heads, built from a corpus and, when given, QA labels.

Self-supervised (any indexed corpus, no labels):

* IsRel — inverse cloze: one sentence of a passage is the query; the rest of that passage is
  relevant, the retriever's best other passage for that query (a hard negative) irrelevant.
* IsSup — for a topic question about a passage ("What is known about <title>?"): one of its
  sentences verbatim is fully supported; the same sentence with one year, number or name
  replaced by another of the same kind from the corpus is not supported; the sentence followed
  by a sentence of another passage is partially supported.
* IsUse — for the same topic question: a sentence of that passage rates 5, a sentence of an
  unrelated passage rates 1 (ratings 2-4 get no examples).
* Retrieve — a question with no answer written yet needs retrieval (yes); once a supported
  sentence answering it is written, it does not (no). `continue` gets no examples.

Labelled QA (SQuAD v2 or FlashRAG questions): a retrieved passage containing a gold answer is
relevant, retrieved passages without one irrelevant; a draft containing a gold answer is fully
supported and rates 5; any other draft (wrong, or for an unanswerable question) is not supported
and rates 1.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from selfrag.pipeline.critics import Branch
from selfrag.pipeline.evaluation.qa_metrics import contains_answer
from selfrag.pipeline.protocols import Passage
from selfrag.pipeline.segmenting import sentence_spans

_YEAR = re.compile(r"\b(?:1[0-9]{3}|20[0-9]{2})\b")
_NUMBER = re.compile(r"\b\d+(?:[.,]\d+)?\b")
# Capitalised word runs not at the start of the sentence (names, places, organisations).
_NAME = re.compile(r"(?<=[a-z,;:()] )[A-Z][a-z]+(?: (?:of |de |von )?[A-Z][a-z]+)*")
MIN_WORDS = 6


@dataclass(frozen=True)
class Example:
    """One labelled read of a reflection group: at `branch`, after the segment `answer`."""

    group: str
    label: str
    branch: Branch
    answer: str = ""
    source: str = ""
    key: str = ""
    """What the example is about (a passage or question id): validation splits by it."""


def sentences(text: str) -> list[str]:
    """The sentences of `text` with at least MIN_WORDS words."""
    pieces = (text[start:end] for start, end in sentence_spans(text))
    return [s for s in pieces if len(s.split()) >= MIN_WORDS]


def topic_question(p: Passage) -> str:
    return f"What is known about {p.title}?" if p.title else "What does this text say?"


@dataclass
class EntityPool:
    """Years, other numbers and names seen in a corpus, for same-kind replacements."""

    kinds: dict[str, list[str]] = field(
        default_factory=lambda: {"year": [], "number": [], "name": []}
    )

    @classmethod
    def from_texts(cls, texts: Sequence[str]) -> EntityPool:
        pool = cls()
        seen: dict[str, set[str]] = {k: set() for k in pool.kinds}
        for text in texts:
            for kind, value in _entities(text):
                if value not in seen[kind]:
                    seen[kind].add(value)
                    pool.kinds[kind].append(value)
        return pool

    def replace_one(self, sentence: str, rng: random.Random) -> str | None:
        """`sentence` with one entity swapped for another of its kind; None if it has none."""
        found = [(kind, m) for kind, m in entity_matches(sentence) if len(self.kinds[kind]) > 1]
        if not found:
            return None
        kind, match = rng.choice(found)
        value = match.group(0)
        choices = [v for v in self.kinds[kind] if v != value and v.lower() not in sentence.lower()]
        if not choices:
            return None
        return sentence[: match.start()] + rng.choice(choices) + sentence[match.end() :]


def entity_matches(text: str) -> list[tuple[str, re.Match[str]]]:
    """The years, other numbers and names in `text`, each as (kind, match)."""
    out: list[tuple[str, re.Match[str]]] = [("year", m) for m in _YEAR.finditer(text)]
    years = {m.span() for _, m in out}
    out += [("number", m) for m in _NUMBER.finditer(text) if m.span() not in years]
    out += [("name", m) for m in _NAME.finditer(text)]
    return out


def _entities(text: str) -> list[tuple[str, str]]:
    return [(kind, m.group(0)) for kind, m in entity_matches(text)]


def inverse_cloze(
    passages: Sequence[Passage],
    rng: random.Random,
    hard_negative: Callable[[str, Passage], Passage | None],
) -> list[Example]:
    """IsRel pairs: a sentence as the query, the rest of its passage, a retrieved other one."""
    out: list[Example] = []
    for p in passages:
        sents = sentences(p.text)
        if len(sents) < 3:
            continue
        j = rng.randrange(len(sents))
        query = sents[j]
        rest = Passage(p.id, " ".join(sents[:j] + sents[j + 1 :]), p.title)
        out.append(
            Example("relevance", "relevant", Branch(query, "", rest), source="ict", key=p.id)
        )
        negative = hard_negative(query, p)
        if negative is not None:
            out.append(
                Example(
                    "relevance", "irrelevant", Branch(query, "", negative), source="ict", key=p.id
                )
            )
    return out


def support_examples(
    passages: Sequence[Passage], others: Sequence[Passage], rng: random.Random, pool: EntityPool
) -> list[Example]:
    """IsSup triples per passage: its sentence (full), swapped (none), blended (partial)."""
    out: list[Example] = []
    for p in passages:
        sents = sentences(p.text)
        swaps = [(s, pool.replace_one(s, rng)) for s in sents]
        swaps = [(s, w) for s, w in swaps if w is not None]
        if not swaps:
            continue
        sentence, swapped = rng.choice(swaps)
        branch = Branch(topic_question(p), "", p)
        foreign = _foreign_sentence(p, others, rng)
        out.append(Example("support", "full", branch, sentence, "sentence", p.id))
        out.append(Example("support", "none", branch, swapped, "swap", p.id))
        if foreign is not None:
            out.append(
                Example("support", "partial", branch, f"{sentence} {foreign}", "blend", p.id)
            )
    return out


def utility_examples(
    passages: Sequence[Passage], others: Sequence[Passage], rng: random.Random
) -> list[Example]:
    """IsUse pairs per passage: a sentence of it rates 5, an unrelated passage's sentence 1."""
    out: list[Example] = []
    for p in passages:
        sents = sentences(p.text)
        foreign = _foreign_sentence(p, others, rng)
        if not sents or foreign is None:
            continue
        branch = Branch(topic_question(p), "", None)
        out.append(Example("utility", "5", branch, rng.choice(sents), "sentence", p.id))
        out.append(Example("utility", "1", branch, foreign, "foreign", p.id))
    return out


def retrieve_examples(passages: Sequence[Passage], rng: random.Random) -> list[Example]:
    """Retrieve pairs per passage: nothing written yet (yes), a supported sentence written (no)."""
    out: list[Example] = []
    for p in passages:
        sents = sentences(p.text)
        if not sents:
            continue
        question = topic_question(p)
        out.append(Example("retrieve", "yes", Branch(question, "", None), source="start", key=p.id))
        written = Branch(question, rng.choice(sents), None)
        out.append(Example("retrieve", "no", written, source="answered", key=p.id))
    return out


def _foreign_sentence(p: Passage, others: Sequence[Passage], rng: random.Random) -> str | None:
    for _ in range(8):
        q = rng.choice(others)
        if q.id != p.id and q.title != p.title:
            sents = sentences(q.text)
            if sents:
                return rng.choice(sents)
    return None


# --- labelled QA ------------------------------------------------------------------------------


def qa_relevance_examples(
    qid: str, question: str, answers: Sequence[str], retrieved: Sequence[Passage]
) -> list[Example]:
    """For an answerable question: retrieved passages with a gold answer relevant, others not."""
    out = []
    for p in retrieved:
        label = "relevant" if contains_answer(p.text, answers) else "irrelevant"
        out.append(Example("relevance", label, Branch(question, "", p), source="qa", key=qid))
    return out


def qa_draft_examples(
    qid: str,
    question: str,
    answers: Sequence[str],
    answerable: bool,
    passage: Passage,
    draft: str,
) -> list[Example]:
    """A draft with a gold answer: full support, utility 5; a draft without one (a wrong
    answer, or any answer to an unanswerable question): no support, utility 1. SQuAD answers
    are spans, so a right draft that paraphrases away every gold span is rare. Utility is
    labelled on the branch the draft was made on: the sequence layout reads it there."""
    if not draft.strip():
        return []
    evidence = Branch(question, "", passage)
    closed = Branch(question, "", None)
    if answerable and contains_answer(draft, answers):
        return [
            Example("support", "full", evidence, draft, "qa", qid),
            Example("utility", "5", evidence, draft, "qa", qid),
            Example("retrieve", "yes", closed, source="qa", key=qid),
        ]
    if not answerable:
        return [
            Example("support", "none", evidence, draft, "qa-unanswerable", qid),
            Example("utility", "1", evidence, draft, "qa-unanswerable", qid),
        ]
    return [
        Example("support", "none", evidence, draft, "qa-wrong", qid),
        Example("utility", "1", evidence, draft, "qa-wrong", qid),
    ]
