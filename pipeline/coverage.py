"""What a long answer must cover: the parts of a question, what each step searches for, and
when the answer is complete.

A question asks for one thing ("Who founded Normandy?"), for several listed things ("Where is
Coronation Park, when was the Durbar held there, and which statues stand in it?", "Tell me
about X: where …, when …"), or for an open account of a topic ("Tell me about Andrew
Carnegie."). `plan_question` reads which, from the question's wording alone (its conjunctions,
its wh-words and its lead-in), with no model call. The decoder then gives each listed part a
step of its own, searches for what is still missing, and stops once the parts are answered
(or dropped), instead of when one segment fails.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from selfrag.pipeline.protocols import Passage
from selfrag.pipeline.ranking import Hypothesis
from selfrag.schemas.decoding import DecodingConfig

# Lead-ins that ask for an account of a topic rather than one fact.
_TOPIC_LEAD = re.compile(
    r"^\s*(?:please\s+)?(?:(?:can|could|would)\s+you\s+)?"
    r"(?:tell\s+me\s+(?:a\s+(?:short\s+)?(?:bio(?:graphy)?|history)\s+of|(?:all\s+|more\s+)?"
    r"about)|give\s+(?:me\s+)?(?:an?\s+)?(?:overview|summary|account|bio(?:graphy)?|history)\s+"
    r"of|describe|summari[sz]e|introduce|what\s+do\s+you\s+know\s+about|write\s+(?:a\s+)?"
    r"(?:short\s+)?(?:bio(?:graphy)?|summary|paragraph)\s+(?:of|about|on))\s+",
    re.IGNORECASE,
)
_PREP = r"(?:in|on|at|from|for|to|by|with|of|during|under|after|before|into|through)"
_WH = rf"(?:(?:{_PREP}\s+)?(?:which|what|whom|whose)|who|when|where|why|how)"
# Where one listed part ends and the next begins: a semicolon, a second question mark, or a
# comma or "and" (or both) before a wh-word; in a list after a topic, also ", and" before its
# last item ("when …, which …, and its first aircraft type").
_BREAK = (
    rf"\s*(?:;|\?|,\s*(?:and\s+|or\s+|as\s+well\s+as\s+|also\s+)?(?={_WH}\b)|"
    rf"\s(?:and|or|as\s+well\s+as)\s+(?:also\s+)?(?={_WH}\b)"
)
_PART_BREAK = re.compile(rf"{_BREAK})\s*", re.IGNORECASE)
_LIST_BREAK = re.compile(rf"{_BREAK}|,\s*and\s+)\s*", re.IGNORECASE)
_WH_ONLY = re.compile(rf"{_WH}(?:\s+(?:and|or)\s+{_WH})*", re.IGNORECASE)
_WH_START = re.compile(rf"^{_WH}\s+", re.IGNORECASE)
_WH_WORD = re.compile(rf"\b{_WH}\b", re.IGNORECASE)
_AUX = (
    r"(?:is|are|was|were|am|did|does|do|has|have|had|can|could|will|would|should|shall|may|"
    r"might|must)"
)
# The start of a question of its own: an auxiliary inverted after its wh-word ("when did",
# "where is"), "how" with its adjective ("how many", "how wide is"), "which"/"what"/"whose"
# (after a preposition or not) with a noun phrase and its verb ("which 1978 report
# recommended", "in which village was"), or "who"/"what" with its verb; or a yes/no
# question's auxiliary.
_ASKS = re.compile(
    rf"(?:{_WH}\s+{_AUX}\b|how\s+(?:many|much|long|old|far|big|large|often)\b|"
    rf"how\s+\w+\s+{_AUX}\b|"
    rf"(?:{_PREP}\s+)?(?:which|what|whose)\s+(?!{_AUX}\b)[\w'’`–-]+(?:\s+[\w'’`–-]+){{0,5}}?\s+"
    rf"(?:{_AUX}\b|\w+(?:ed|s)\b)|"
    rf"who\s|what\s+\w+(?:ed|s)\b|{_AUX}\s)",
    re.IGNORECASE,
)
# A clause that opens a question without asking ("When a batch job fails, how do I …"), and
# the question after such a clause ("While it runs: where does …").
_SUBORDINATE = re.compile(
    rf"^(?:when|where|if|once|while|whenever|after|before|since)\s+(?!{_AUX}\b)", re.IGNORECASE
)
_ASKS_AFTER_CLAUSE = re.compile(rf"[,:]\s*{_ASKS.pattern}", re.IGNORECASE)
_CAPITALISED = re.compile(r"\b[A-Z][\w'’.-]*(?:\s+(?:of|the|de|du|la|von|van|[A-Z][\w'’.-]*))*")
# Words that start a part but name nothing it is about.
_LEADING = frozenset(
    """who whom whose what when where which why how in on at from for to by with and or
    the a an was were is are did does do has have had its it his her their""".split()
)
# A part needs this many words to stand as a question of its own ("and when" does not).
MIN_PART_WORDS = 2


@dataclass(frozen=True)
class QuestionPlan:
    """What a question asks for: `parts` it lists (empty when it asks one thing), the `topic`
    an account is asked of ("Tell me about X"), and `open_ended` when it asks for such an
    account with no parts listed."""

    question: str
    parts: tuple[str, ...] = ()
    topic: str | None = None
    open_ended: bool = False

    @property
    def long(self) -> bool:
        """Whether a good answer takes more than one segment."""
        return bool(self.parts) or self.open_ended

    def part_question(self, index: int) -> str:
        """The part at `index` as a question a passage can answer on its own: the part, with
        the topic (or the first part's names) it leaves out, for a part that says "there" or
        "it" instead."""
        part = self.parts[index]
        context = self.topic or (names(self.parts[0]) if index else "")
        if context and not _mentions(part, context):
            part = f"{part} ({context})"
        return part if part.endswith("?") else f"{part}?"


def plan_question(question: str) -> QuestionPlan:
    """The parts `question` asks for (`QuestionPlan`), from its wording alone."""
    text = " ".join(question.split())
    topic = None
    body = text
    lead = _TOPIC_LEAD.match(text)
    if lead is not None:
        rest = text[lead.end() :]
        subject, colon, listed = rest.partition(":")
        if colon and listed.strip():
            topic, body = _clean(subject), listed
        else:
            topic = _clean(rest)
            return QuestionPlan(question, topic=topic or None, open_ended=bool(topic))
    parts = split_parts(body, listed=topic is not None)
    if len(parts) < 2 and topic is None:
        return QuestionPlan(question)
    if len(parts) < 2:
        return QuestionPlan(question, topic=topic, open_ended=True)
    return QuestionPlan(question, parts=tuple(parts), topic=topic)


def split_parts(text: str, *, listed: bool = False) -> list[str]:
    """`text` cut where one question it asks ends and the next begins (`_PART_BREAK`). In a
    question, what follows a break must read as a question of its own (`_ASKS`: "when did it
    …", "which king …", not "when none is set"); in a list after a topic (`listed`), any
    wh-word starts a part ("where it is, when …"). A leading clause that asks nothing ("In
    1962, who …") belongs to the part after it; wh-words alone ("When and where was he
    born?") share the next part's rest."""
    starts = [0]
    ends = []
    for m in (_LIST_BREAK if listed else _PART_BREAK).finditer(text):
        following = text[m.end() :]
        if m.start() == 0 or not following.strip():
            continue
        separator = m.group(0).strip()
        if separator in (";", "?") or listed or _ASKS.match(following):
            ends.append(m.start())
            starts.append(m.end())
    ends.append(len(text))
    pieces = [_clean(text[a:b]) for a, b in zip(starts, ends, strict=True)]
    parts: list[str] = []
    asks = False  # whether the last part asks something yet (else it is a leading clause)
    waiting: list[str] = []
    for piece in (p for p in pieces if p):
        if _WH_ONLY.fullmatch(piece):
            waiting.append(piece)
            continue
        parts += [f"{wh} {_WH_START.sub('', piece, count=1)}" for wh in waiting]
        asks = asks or bool(waiting)
        waiting = []
        if parts and not asks:
            parts[-1] = f"{parts[-1]}, {piece}"  # a leading clause: context of this part
        elif parts and len(piece.split()) < MIN_PART_WORDS:
            parts[-1] = f"{parts[-1]} {piece}"
        else:
            parts.append(piece)
        asks = (
            listed
            or bool(_ASKS_AFTER_CLAUSE.search(piece))
            or (
                not _SUBORDINATE.match(piece) and bool(_ASKS.match(piece) or _WH_WORD.search(piece))
            )
        )
    if waiting and not parts:
        parts = waiting
    return [p[0].upper() + p[1:] for p in parts]


def names(text: str) -> str:
    """The capitalised names of `text` other than its leading wh-word, joined: what a later
    part that says "there" or "it" refers to."""
    found = []
    for m in _CAPITALISED.finditer(text):
        words = m.group(0).split()
        while words and words[0].lower() in _LEADING:
            words = words[1:]
        if words:
            found.append(" ".join(words))
    return " ".join(dict.fromkeys(found))


def _mentions(part: str, context: str) -> bool:
    words = {w.lower() for w in re.findall(r"\w+", part)}
    return all(w.lower() in words for w in re.findall(r"\w+", context))


def _clean(text: str) -> str:
    return text.strip(" \t,;:.?!").strip()


# Steps in a row that may add nothing before an open account ends: a failed step can be a
# passage that did not hold up, or a draft that ended the answer early; three in a row say the
# evidence has no more to give.
MAX_MISSES = 3
# A question asking one thing is answered in one statement: a segment the token cap cut gets
# one continuation to finish it, never an account of its own.
SHORT_CONTINUATIONS = 1


def settle(plan: QuestionPlan, h: Hypothesis) -> Hypothesis:
    """`h` after a step, `done` when its answer is complete: a segment cut mid-sentence goes
    on (in a question asking one thing, `SHORT_CONTINUATIONS` times); a question asking one
    thing is answered by its first step (or abstained on); one listing parts once each part
    had its step; an open account after `MAX_MISSES` steps in a row added nothing (or at
    `max_segments`, which ranking marks)."""
    continues = plan.long or len(h.segments) <= SHORT_CONTINUATIONS
    if not h.done and h.cut and continues:
        return h
    if h.done or not plan.long:
        done = True
    elif plan.parts:
        done = h.part >= len(plan.parts)
    else:
        done = h.misses >= MAX_MISSES
    return replace(h, done=done, abstained=done and not h.segments)


def search_query(plan: QuestionPlan, h: Hypothesis, cfg: DecodingConfig) -> str:
    """What the next step of `h` searches for (`DecodingConfig.segment_retrieval`): for a
    part of a question listing parts, that part (`part`), every part still to answer
    (`missing`), or the question and the answer so far (`answer`, past the first step); a
    question asking one thing, or `static`'s one search, the question; an open account the
    question, then its topic (`answer`: the question and the answer so far); past a first
    segment cut mid-sentence, the question and the answer so far."""
    question = " ".join(plan.question.split())
    with_answer = " ".join(f"{question} {h.text}".split())
    strategy = cfg.segment_retrieval
    if plan.parts and h.part < len(plan.parts):
        if strategy == "part":
            return plan.part_question(h.part)
        if strategy == "missing":
            context = plan.topic or names(plan.parts[0])
            return " ".join(f"{context} {' '.join(plan.parts[h.part :])}".split())
    if h.segments and (h.cut or not plan.long or strategy == "answer"):
        return with_answer
    if h.segments and plan.open_ended and plan.topic and strategy in ("part", "missing"):
        # The lead-in ("Tell me a bio of") draws other people's biographies; the topic
        # alone reaches more of its own passages.
        return plan.topic
    return question


def about_topic(plan: QuestionPlan, passage: Passage) -> bool:
    """Whether `passage` is about the topic an account is asked of: its title holds at least
    half of the topic's words, or its text all of them. A later step of an open account draws
    only on such passages (a search past the ones used reaches into others, which name one of
    the topic's words in passing). True without a topic."""
    if not plan.open_ended or not plan.topic:
        return True
    words = _topic_words(plan.topic)
    if not words:
        return True
    in_title = words & _topic_words(passage.title or "")
    return 2 * len(in_title) >= len(words) or words <= _topic_words(passage.text)


def _topic_words(text: str) -> set[str]:
    return {w for w in re.findall(r"\w+", text.casefold()) if len(w) > 2 and w not in _LEADING}


def branch_question(plan: QuestionPlan, h: Hypothesis) -> str:
    """The question the next step of `h` drafts and is critiqued on: the part it answers, for
    a question listing parts; else the question."""
    if plan.parts and h.part < len(plan.parts):
        return plan.part_question(h.part)
    return plan.question
