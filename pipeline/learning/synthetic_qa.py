"""Label-free question/passage pairs from an indexed corpus, and the support threshold they give.

A sentence of a sampled passage that holds an entity (a year, another number or a name, the
patterns of `pipeline.learning.reflection_data`) becomes a question whose answer is that entity:

* `wh` (default): the entity replaced in place by a wh-phrase, around it at most `WINDOW` words
  of the sentence: "... under their leader who?", "... in what year?", "... how many ...?";
* `cloze`: the same words with the entity blanked: "... under their leader ___ ." as a
  fill-in-the-blank request.

The answerable pair is the question with its own passage; the unanswerable pair is the same
question with the retriever's best other passage that does not contain the answer string (a
near neighbour that lacks it). Everything is drawn from a seeded `random.Random`, so the same
passages, search results and seed give the same pairs.

`choose_threshold` turns the critique's s_sup on both kinds of pair into a `min_support_score`.
An index of several collections (corpus files) is sampled per collection
(`sample_by_collection`) and thresholded per collection, since s_sup's scale differs between
them; the lowest of the collections' own (`lowest_threshold`) holds passages of a collection
without one, so that no collection's answerable pairs abstain more often than the budget allows.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from selfrag.pipeline.evaluation.qa_metrics import contains_answer
from selfrag.pipeline.learning.reflection_data import entity_matches, sentences
from selfrag.pipeline.protocols import COLLECTION, Passage

QuestionStyle = Literal["wh", "cloze"]
STYLES: tuple[str, ...] = ("wh", "cloze")
WINDOW = 10
"""Words kept on each side of the entity: real questions are short (SQuAD's average about 10
words), whole encyclopaedia sentences are not."""
NEIGHBOUR_DEPTH = 8
"""Retrieved passages searched for a near neighbour without the answer."""
_WH = {"year": "what year", "number": "how many", "name": "who"}
"""The wh-phrase asking for each entity kind (a count's noun stays after "how many")."""
_LEADING = re.compile(r"^\W+|[\s,;:]+$")
_FUNCTION = frozenset(
    "was is were are had has and or in of who which to from at on for by as with when after "
    "before but".split()
)
_MONTHS = frozenset(
    "January February March April May June July August September October November December".split()
)
# A plain word, with the quotes, brackets and punctuation prose puts around it.
_PLAIN_WORD = re.compile(r"[\"“‘'(]*[^\W\d_]+(?:['’-][^\W\d_]+)*[.,;:!?)\"”’']*")
MIN_PLAIN_SHARE = 2 / 3
"""The share of a question's words (the entity's kind aside) that must be plain words
(`reads_as_prose`)."""


@dataclass(frozen=True)
class SyntheticQuestion:
    """A question drawn from `passage`, whose answer is `answer` (a span of it)."""

    question: str
    answer: str
    kind: str
    """The entity kind: year, number or name."""
    passage: Passage


TrapKind = Literal["neighbour", "entity", "number", "negation", "antonym"]
TRAP_KINDS: tuple[str, ...] = ("neighbour", "entity", "number", "negation", "antonym")


@dataclass(frozen=True)
class SyntheticPair:
    """A question with a passage; `answerable` when the passage is the one it came from and
    the question is as written from it. An unanswerable pair's `trap` says how it was made:
    `neighbour`, the question with the retriever's best other passage lacking its answer; the
    others, a perturbed question on the question's own passage (`perturbed_questions`)."""

    question: SyntheticQuestion
    passage: Passage
    answerable: bool
    trap: TrapKind | None = None


def make_question(
    sentence: str, rng: random.Random, style: QuestionStyle = "wh"
) -> tuple[str, str, str] | None:
    """(question, answer, kind) from one entity of `sentence`, or None when it has none, the
    words around it do not read as prose (`reads_as_prose`), or the answer would still be
    written in the question."""
    found = [(kind, m) for kind, m in entity_matches(sentence) if _askable(sentence, kind, m)]
    if not found:
        return None
    kind, match = rng.choice(found)
    answer = match.group(0)
    before = sentence[: match.start()].split()[-WINDOW:]
    after = sentence[match.end() :].split()[:WINDOW]
    if not reads_as_prose(before + after):
        return None
    left = _LEADING.sub("", " ".join(before))
    right = _LEADING.sub("", " ".join(after).rstrip(".!?"))
    while right.split()[-1:] and right.split()[-1] in _FUNCTION | {"the", "a", "an"}:
        right = _LEADING.sub("", right.rsplit(" ", 1)[0] if " " in right else "")
    if style == "cloze":
        text = " ".join(w for w in (left, "___", right) if w)
        question = f"Fill in the blank: {text}."
    else:
        question = " ".join(w for w in (left, _WH[kind], right) if w) + "?"
        question = question[0].upper() + question[1:]
    if contains_answer(question, [answer]):
        return None
    return question, answer, kind


def reads_as_prose(words: Sequence[str]) -> bool:
    """Whether the words a question is made of read as prose: no table bars or markup, and at
    least MIN_PLAIN_SHARE of them plain words, not numbers, code or symbols. A table row or a
    log line of a technical corpus makes a question no one asks, whose answer the model cannot
    read off the passage, and it would count as an answerable pair all the same."""
    if any(c in w for w in words for c in "|<>{}"):
        return False
    return sum(1 for w in words if _PLAIN_WORD.fullmatch(w)) >= MIN_PLAIN_SHARE * len(words)


def _askable(sentence: str, kind: str, m: re.Match[str]) -> bool:
    """Whether the entity `m` is a whole one a question can ask for: a year; a count followed
    by a plural noun ("12 weeks"); a name of 3+ letters after a lower-case word and not part
    of a longer name or a compound ("Prince's Dock", "UK Albums Chart", "Carnegie-donated")."""
    before = sentence[: m.start()].split()[-1:]
    rest = sentence[m.end() :]
    after = [w.strip(".,;:()") for w in rest.split()[:1]]
    if kind == "year":
        return True
    if kind == "number":
        return bool(after) and re.fullmatch(r"[a-z]+s", after[0]) is not None
    return (
        len(m.group(0)) >= 3
        and m.group(0) not in _MONTHS
        and bool(before)
        and before[0].isalpha()
        and before[0].islower()
        # Followed by punctuation or a function word: "leader Rollo, agreed", "by Rollo in",
        # not an adjective or a compound ("Norse raiders", "Carnegie-donated").
        and (rest[:1] in ("", ".", ",", ";", ":", ")") or bool(after and after[0] in _FUNCTION))
    )


def sample_by_collection(
    stream: Iterable[Passage], k: int, rng: random.Random
) -> dict[str, list[Passage]]:
    """Up to `k` passages drawn uniformly from each collection of `stream` (one reservoir per
    collection, in one pass); passages without a recorded collection form the collection ""."""
    seen: dict[str, int] = {}
    chosen: dict[str, list[Passage]] = {}
    for p in stream:
        name = p.metadata.get(COLLECTION, "")
        i = seen.get(name, 0)
        seen[name] = i + 1
        group = chosen.setdefault(name, [])
        if i < k:
            group.append(p)
        else:
            j = rng.randrange(i + 1)
            if j < k:
                group[j] = p
    return chosen


def synthetic_pairs(
    passages: Sequence[Passage],
    search: Callable[[str, int], list[Passage]],
    n: int,
    rng: random.Random,
    style: QuestionStyle = "wh",
) -> list[SyntheticPair]:
    """The pairs of the first `n` questions of `question_pairs`, in order."""
    return [
        pair
        for group in itertools.islice(question_pairs(passages, search, rng, style), n)
        for pair in group
    ]


def question_pairs(
    passages: Sequence[Passage],
    search: Callable[[str, int], list[Passage]],
    rng: random.Random,
    style: QuestionStyle = "wh",
) -> Iterator[list[SyntheticPair]]:
    """The pairs of one question at a time, from `passages` in a seeded order (drawn as they are
    asked for): the answerable pair first, then the unanswerable ones, the question with a near
    neighbour without its answer, when the retriever finds one, and a perturbed question on its
    own passage (`perturbed_questions`), when one can be made. A passage without a sentence to
    ask about gives none."""
    pool = entity_pool(passages)
    order = list(passages)
    rng.shuffle(order)
    for p in order:
        q = question_for(p, rng, style)
        if q is None:
            continue
        pairs = [SyntheticPair(q, p, True)]
        neighbour = near_neighbour(q, search)
        if neighbour is not None:
            pairs.append(SyntheticPair(q, neighbour, False, "neighbour"))
        perturbed = perturbed_questions(q, pool, rng)
        if perturbed:
            # One trap of the question's own passage per question, of a kind drawn at random.
            kind, text = rng.choice(perturbed)
            pairs.append(SyntheticPair(replace(q, question=text), p, False, kind))
        yield pairs


def entity_pool(passages: Iterable[Passage]) -> dict[str, list[str]]:
    """The names and numbers of `passages` by kind (sorted, distinct): what an entity or number
    swap draws its substitutes from, so a swapped-in name is one the corpus itself uses."""
    pool: dict[str, set[str]] = {}
    for p in passages:
        for kind, m in entity_matches(p.text):
            pool.setdefault(kind, set()).add(m.group(0))
    return {kind: sorted(values) for kind, values in pool.items()}


# Word pairs whose swap turns a question into one about the opposite (SQuAD 2.0's antonym traps).
_ANTONYMS = {
    "first": "last", "last": "first", "earliest": "latest", "latest": "earliest",
    "largest": "smallest", "smallest": "largest", "most": "least", "least": "most",
    "before": "after", "after": "before", "highest": "lowest", "lowest": "highest",
    "north": "south", "south": "north", "east": "west", "west": "east",
    "older": "younger", "younger": "older", "won": "lost", "lost": "won",
    "began": "ended", "ended": "began", "increased": "decreased", "decreased": "increased",
    "longest": "shortest", "shortest": "longest", "biggest": "smallest", "oldest": "newest",
    "newest": "oldest", "joined": "left", "left": "joined", "born": "buried",
}  # fmt: skip
_AUXILIARY = re.compile(r"\b(was|were|is|are|did|does|do|had|has|have|could|can|would|will)\b")


def perturbed_questions(
    q: SyntheticQuestion, pool: dict[str, list[str]], rng: random.Random
) -> list[tuple[TrapKind, str]]:
    """Unanswerable variants of `q` on its own passage, as SQuAD 2.0's annotators wrote them:
    a name or a number of the question swapped for another of the corpus that the passage does
    not hold (`entity`, `number`), a negation (`negation`), or a word swapped for its antonym
    (`antonym`). Each variant is a question the passage leaves unanswered, or answers with
    something other than `q.answer`; only variants that differ from `q` are returned."""
    text, passage = q.question, q.passage.text
    out: list[tuple[TrapKind, str]] = []
    for kind, m in entity_matches(text):
        choices = [v for v in pool.get(kind, []) if v != m.group(0) and v not in passage]
        if choices:
            swapped = text[: m.start()] + rng.choice(choices) + text[m.end() :]
            out.append(("number" if kind in ("year", "number") else "entity", swapped))
    aux = _AUXILIARY.search(text)
    if aux is not None and " not " not in f" {text.lower()} ":
        out.append(("negation", text[: aux.end()] + " not" + text[aux.end() :]))
    words = text.split()
    for i, word in enumerate(words):
        core = word.strip("?,.;:").lower()
        if core in _ANTONYMS:
            swapped_word = word.lower().replace(core, _ANTONYMS[core])
            out.append(("antonym", " ".join([*words[:i], swapped_word, *words[i + 1 :]])))
            break
    return [(kind, t) for kind, t in out if t != text]


def question_for(p: Passage, rng: random.Random, style: QuestionStyle) -> SyntheticQuestion | None:
    """A question from one of `p`'s sentences that holds an entity, or None."""
    sents = sentences(p.text)
    rng.shuffle(sents)
    for sentence in sents:
        made = make_question(sentence, rng, style)
        if made is not None:
            question, answer, kind = made
            return SyntheticQuestion(question, answer, kind, p)
    return None


def near_neighbour(
    q: SyntheticQuestion, search: Callable[[str, int], list[Passage]]
) -> Passage | None:
    """The retriever's best passage for `q` other than its own that lacks its answer."""
    for p in search(q.question, NEIGHBOUR_DEPTH):
        if p.id != q.passage.id and not contains_answer(p.text, [q.answer]):
            return p
    return None


# --- the threshold ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ThresholdChoice:
    """A `min_support_score` and what it does on the synthetic pairs."""

    threshold: float
    answerable_abstain: float
    """Fraction of answerable pairs whose s_sup is below the threshold."""
    unanswerable_abstain: float | None
    """Fraction of unanswerable pairs below it (None without any)."""


def choose_threshold(
    answerable: Sequence[float], unanswerable: Sequence[float], max_answerable_abstain: float
) -> ThresholdChoice:
    """The highest threshold that abstains (s_sup < threshold) on at most
    `max_answerable_abstain` of the answerable pairs: as many unanswerable pairs abstain as the
    budget on answerable ones allows (the abstained fraction only grows with the threshold).

    It is the smallest answerable score above the allowed ones, so exactly
    floor(max_answerable_abstain · n) answerable pairs fall below it; ValueError without any.
    """
    if not answerable:
        raise ValueError("no answerable pairs to choose a threshold from")
    if not 0.0 <= max_answerable_abstain < 1.0:
        raise ValueError("max_answerable_abstain must be in [0, 1)")
    ranked = sorted(answerable)
    allowed = math.floor(max_answerable_abstain * len(ranked) + 1e-9)
    return threshold_effect(ranked[allowed], ranked, unanswerable)


def threshold_effect(
    threshold: float, answerable: Sequence[float], unanswerable: Sequence[float]
) -> ThresholdChoice:
    """What `threshold` abstains on (s_sup below it) among non-empty `answerable` pairs and
    `unanswerable` ones."""
    below = sum(1 for s in answerable if s < threshold) / len(answerable)
    unans = (
        sum(1 for s in unanswerable if s < threshold) / len(unanswerable) if unanswerable else None
    )
    return ThresholdChoice(threshold, below, unans)


def lowest_threshold(choices: dict[str, ThresholdChoice]) -> tuple[str, ThresholdChoice]:
    """The collection whose threshold is lowest, and its choice: with it every collection
    abstains on at most its budget of answerable pairs (a higher one would exceed it there)."""
    if not choices:
        raise ValueError("no collection to choose a threshold from")
    name = min(sorted(choices), key=lambda c: choices[c].threshold)
    return name, choices[name]


def summary(scores: Sequence[float]) -> dict[str, float | int]:
    """n, mean and the 10/25/50/75/90th percentiles (nearest rank) of `scores`."""
    if not scores:
        return {"n": 0}
    ranked = sorted(scores)
    out: dict[str, float | int] = {"n": len(ranked), "mean": round(sum(ranked) / len(ranked), 4)}
    for q in (10, 25, 50, 75, 90):
        out[f"p{q}"] = round(ranked[min(len(ranked) - 1, int(q / 100 * len(ranked)))], 4)
    return out
