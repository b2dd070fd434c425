"""Long-form answer metrics as pure functions: which of a question's listed facts an answer
states, and whether the passages its units cite back what those units state (ALCE-style
citation recall and precision, judged lexically: no NLI model).

Definitions (docs/long-form-metrics.md has them with examples):

- A fact is *stated* by a text when any of its answers occurs in it, and a passage *holds* a
  fact when any of its answers occurs in the passage's text (`qa_metrics.contains_answer`:
  SQuAD-normalised, on word boundaries).
- A *unit* is a piece of an answer that can carry citations: a Self-RAG segment (citing its
  passage, or nothing), or a sentence of a baseline's answer (citing the passages its `[n]`
  markers name, `marker_units`). A *citing unit* cites at least one passage.
- Citation recall: of the facts the answer states, the share stated in a unit that cites a
  passage holding the fact.
- Citation precision: of the citing units, the share whose cited passages support what they
  state. A unit stating a listed fact is supported when a cited passage holds a fact it
  states; a unit stating none (a *filler*) is supported when its cited passages ground it
  lexically (`grounded`). Several passages cited by one unit are judged as one set (ALCE: a
  citation set supports a statement when it, together, does; one passage alone then suffices
  for a fact).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from selfrag.pipeline.evaluation.qa_metrics import contains_answer, mean_or_none
from selfrag.pipeline.grounding import missing_terms, word_share
from selfrag.pipeline.segmenting import sentence_spans

FILLER_WORD_SHARE = 0.8
"""The share of a filler's content words its cited passages must hold (`grounded`)."""


@dataclass(frozen=True)
class Fact:
    """One fact a long-form question asks for: `answers[0]` the gold, the rest aliases."""

    id: str
    answers: tuple[str, ...]
    part: str = ""


@dataclass(frozen=True)
class Unit:
    """A piece of an answer that can carry citations, and the ids of the passages it cites
    (empty: none)."""

    text: str
    cited: tuple[str, ...] = ()


@dataclass(frozen=True)
class SourcePassage:
    """A passage an answer was given: its text (what holds facts) and title (shown with it)."""

    text: str
    title: str | None = None

    @property
    def shown(self) -> str:
        return f"{self.title}\n{self.text}" if self.title else self.text


# "[2]", "[1, 3]", "[1; 3]", "[Passage 2]": the ways a model cites passages numbered [1]..[k].
_ONE_MARKER = r"\[\s*(?:passage\s*)?(\d+(?:\s*[,;]\s*\d+)*)\s*\]"
_MARKER = re.compile(_ONE_MARKER, re.IGNORECASE)
# Markers written after a sentence's end on its line ("... 1929. [2] He ...") belong to it.
_AFTER_END = re.compile(rf"([.!?][\"'”’)]*)((?:[ \t]*{_ONE_MARKER})+)", re.IGNORECASE)
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([.,;:!?])")


def strip_markers(text: str) -> str:
    """`text` without its `[n]` citation markers."""
    without = _MARKER.sub(" ", text)
    return " ".join(_SPACE_BEFORE_PUNCT.sub(r"\1", without).split())


def marker_units(text: str, passage_ids: Sequence[str]) -> list[Unit]:
    """The sentences of `text` (lines first, then `segmenting.sentence_spans`), each with the
    passages its `[n]` markers name (n counts from 1 over `passage_ids`), markers removed from
    the text. A marker after a sentence's end on its line belongs to that sentence. A piece
    without a letter (markers alone, a list's "1.") is no sentence: its markers go to the
    sentence after it when it opens a line that goes on ("[2]. It was ..."), else to the one
    before ("... 1929.\n[2]"). A number naming no passage is kept as its marker ("[7]"), a
    citation no passage backs."""
    moved = _AFTER_END.sub(lambda m: m.group(2) + m.group(1), text)
    units: list[Unit] = []
    ahead: tuple[str, ...] = ()  # markers that label what follows them
    for line in moved.splitlines():
        spans = sentence_spans(line)
        for i, (start, end) in enumerate(spans):
            sentence = line[start:end]
            numbers = [
                int(n) for m in _MARKER.finditer(sentence) for n in re.split(r"[,;]", m.group(1))
            ]
            cited = tuple(
                passage_ids[n - 1] if 1 <= n <= len(passage_ids) else f"[{n}]" for n in numbers
            )
            said = strip_markers(sentence)
            if re.search(r"[^\W\d_]", said):
                units.append(Unit(said, tuple(dict.fromkeys((*ahead, *cited)))))
                ahead = ()
            elif (i == 0 and len(spans) > 1) or not units:
                ahead += cited  # "[2]. It was ..." labels the sentence after it
            else:
                last = units[-1]  # "... 1929.\n[2]" cites the sentence before it
                units[-1] = Unit(last.text, tuple(dict.fromkeys((*last.cited, *cited))))
    return units


def grounded(text: str, evidence: str) -> bool:
    """Whether `evidence` grounds `text` lexically: it holds every number and name `text`
    states (`grounding.missing_terms`) and at least `FILLER_WORD_SHARE` of its content words
    (`grounding.word_share`). A text without a content word states nothing to ground."""
    share = word_share(text, evidence)
    return share is not None and share >= FILLER_WORD_SHARE and not missing_terms(text, evidence)


@dataclass(frozen=True)
class UnitJudgment:
    """One unit judged: the facts it states and, when it cites, whether its citations support
    it (None: it cites nothing)."""

    text: str
    cited: tuple[str, ...]
    states: tuple[str, ...]
    supported: bool | None


@dataclass(frozen=True)
class LongformJudgment:
    """One answer to a long-form question, judged: fact ids listed, stated by the answer, stated
    and cited to a passage holding them, and held by a passage the answer was given."""

    facts: tuple[str, ...]
    stated: tuple[str, ...]
    cited: tuple[str, ...]
    retrieved: tuple[str, ...]
    units: tuple[UnitJudgment, ...]
    abstained: bool

    @property
    def covered(self) -> bool:
        """Every listed fact stated."""
        return bool(self.facts) and len(self.stated) == len(self.facts)

    @property
    def citing(self) -> tuple[UnitJudgment, ...]:
        """The units that cite a passage."""
        return tuple(u for u in self.units if u.supported is not None)

    def rates(self) -> dict[str, float | None]:
        """This answer's own fact recall, citation recall and citation precision
        (`summarize_longform` defines them; None where undefined)."""
        citing = self.citing
        return {
            "fact_recall": len(self.stated) / len(self.facts) if self.facts else None,
            "citation_recall": len(self.cited) / len(self.stated) if self.stated else None,
            "citation_precision": _share(bool(u.supported) for u in citing),
        }


def judge_answer(
    answer: str,
    units: Sequence[Unit],
    passages: Mapping[str, SourcePassage],
    facts: Sequence[Fact],
    *,
    abstained: bool,
) -> LongformJudgment:
    """Judge one answer (module docstring). `passages`: every passage the answer was given, by
    id. An abstained answer states nothing and has no units."""
    if abstained:
        answer, units = "", ()
    text = strip_markers(answer)
    by_id = {f.id: f for f in facts}

    def holds(passage_id: str, fact_id: str) -> bool:
        p = passages.get(passage_id)
        return p is not None and contains_answer(p.text, by_id[fact_id].answers)

    judged = []
    for u in units:
        states = tuple(f.id for f in facts if contains_answer(u.text, f.answers))
        supported: bool | None = None
        if u.cited and states:
            supported = any(holds(p, f) for p in u.cited for f in states)
        elif u.cited:
            evidence = "\n".join(passages[p].shown for p in u.cited if p in passages)
            supported = grounded(u.text, evidence)
        judged.append(UnitJudgment(u.text, u.cited, states, supported))
    stated = tuple(f.id for f in facts if contains_answer(text, f.answers))
    cited = tuple(
        f
        for f in stated
        if any(f in u.states and any(holds(p, f) for p in u.cited) for u in judged)
    )
    retrieved = tuple(f.id for f in facts if any(holds(p, f.id) for p in passages))
    return LongformJudgment(
        facts=tuple(by_id),
        stated=stated,
        cited=cited,
        retrieved=retrieved,
        units=tuple(judged),
        abstained=abstained,
    )


def _share(flags: Iterable[bool]) -> float | None:
    return mean_or_none([float(f) for f in flags])


def summarize_longform(judgments: Sequence[LongformJudgment]) -> dict[str, float | int | None]:
    """One system's long-form report row. Rates in [0, 1], None where undefined; fact rates
    pool the facts of every question (micro averages).

    fact_recall: facts stated over facts listed; fully_covered: questions with every fact
    stated; facts_retrieved: facts held by a passage the answer was given (what a cited answer
    could reach); citation_recall: stated facts cited to a passage holding them, over the
    facts stated; citation_precision: supported citing units over citing units, and the same
    over the units stating a listed fact (citation_precision_facts) and over the fillers
    (filler_precision; filler_units counts them); units_per_answer: units (Self-RAG segments,
    baseline sentences) per answer given; citations_per_unit: passages cited per citing unit;
    abstain_rate: answers abstained.
    """
    facts = sum(len(j.facts) for j in judgments)
    stated = sum(len(j.stated) for j in judgments)
    citing = [u for j in judgments for u in j.citing]
    fillers = [u for u in citing if not u.states]
    answered = [j for j in judgments if not j.abstained]
    return {
        "questions": len(judgments),
        "facts": facts,
        "facts_stated": stated,
        "fact_recall": stated / facts if facts else None,
        "fully_covered": _share(j.covered for j in judgments),
        "facts_retrieved": sum(len(j.retrieved) for j in judgments) / facts if facts else None,
        "citation_recall": sum(len(j.cited) for j in judgments) / stated if stated else None,
        "citation_precision": _share(bool(u.supported) for u in citing),
        "citation_precision_facts": _share(bool(u.supported) for u in citing if u.states),
        "filler_precision": _share(bool(u.supported) for u in fillers),
        "citing_units": len(citing),
        "filler_units": len(fillers),
        "units_per_answer": mean_or_none([float(len(j.units)) for j in answered]),
        "citations_per_unit": mean_or_none([float(len(u.cited)) for u in citing]),
        "abstain_rate": _share(j.abstained for j in judgments),
    }
