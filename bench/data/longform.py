"""The long-form question sets of bench/data: each fact checked against its passage.

`longform_wiki.jsonl` and `longform_bio.jsonl` (passages of
`../shared/data/wiki_sample_1000.jsonl`) and `longform_docs.jsonl` (this repository's README.md
and docs/, as `selfrag index README.md docs` splits them) hold questions that each ask for
several facts, every fact stated in a passage of its own (format and rules:
bench/data/README.md). `python -m bench.data.questions check` runs these checks.

A question must have: each fact's `answers[0]` verbatim in its passage and whole in one of the
passages the indexer makes of it (docs: in its file's section, and whole in one passage of that
section); its facts on distinct passages; no passage
of the corpus stating two of its facts (any of their answers, matched as `selfrag eval` matches
them: SQuAD-normalised, word-bounded), so that no one passage answers it; no answer already in
the question. Answers that would match by accident (a word of three letters or fewer, a number
of one or two digits, a word found across the corpus) are reported as loose.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfrag.infra.corpus.passages import SECTION_SEPARATOR
from selfrag.infra.embeddings.embedder import SentenceEmbedder
from selfrag.jobs.indexing import corpus_passages
from selfrag.pipeline.evaluation.qa_metrics import contains_answer, normalize_answer
from selfrag.pipeline.protocols import Passage
from selfrag.schemas.settings import RetrievalSettings

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
LONGFORM_WIKI = HERE / "longform_wiki.jsonl"
LONGFORM_BIO = HERE / "longform_bio.jsonl"
LONGFORM_DOCS = HERE / "longform_docs.jsonl"
DOCS_CORPUS = ("README.md", "docs")
"""What `selfrag index README.md docs` indexes, relative to the repository."""
SPLITS = ("tune", "report")
COMMON_SHARE = 0.01
"""A one-word answer found in more than this share of the passages outside its own article
(or file) is loose."""


@dataclass(frozen=True)
class SetRules:
    """How many facts a question of a set asks for, and how many questions one article may
    have (0: the set has no articles)."""

    facts: tuple[int, int]
    per_article: int = 0


WIKI_RULES = SetRules(facts=(2, 3), per_article=2)
BIO_RULES = SetRules(facts=(3, 5), per_article=1)
DOCS_RULES = SetRules(facts=(2, 3))


@dataclass
class Findings:
    """What a check found: `problems` break a rule; `loose` answers could match by accident;
    `moved` facts were found under their heading in another file (the record names the old
    one: a note, not a failure)."""

    problems: list[str] = field(default_factory=list)
    loose: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)

    def add(self, other: Findings) -> None:
        self.problems += other.problems
        self.loose += other.loose
        self.moved += other.moved


@dataclass(frozen=True)
class CorpusText:
    """One passage of a corpus: its id, what it belongs to (wiki: the article's title; docs:
    the file), and its text SQuAD-normalised once (the holding test runs often)."""

    id: str
    owner: str
    normalized: str


def corpus_texts(items: Iterable[tuple[str, str, str]]) -> list[CorpusText]:
    """`CorpusText`s of (id, owner, text) triples."""
    return [CorpusText(i, owner, normalize_answer(text)) for i, owner, text in items]


def holders(answers: Sequence[str], corpus: Sequence[CorpusText]) -> list[CorpusText]:
    """The passages that state one of `answers` the way `selfrag eval` matches them."""
    needles = [n for n in (normalize_answer(a) for a in answers) if n]
    return [
        c
        for c in corpus
        if any(n in c.normalized for n in needles) and contains_answer(c.normalized, answers)
    ]


def record_problems(records: Sequence[dict[str, Any]], rules: SetRules) -> list[str]:
    """The rules every long-form set shares: its fields, ids used once, the set's number of
    facts with distinct ids, answers none of which states another fact's or is in the
    question, `golden_answers` the facts' first answers, half the questions in each split."""
    problems: list[str] = []
    seen: set[str] = set()
    low, high = rules.facts
    for r in records:
        rid = r.get("id", "?")
        if rid in seen:
            problems.append(f"{rid}: id used twice")
        seen.add(rid)
        if r.get("split") not in SPLITS:
            problems.append(f"{rid}: split {r.get('split')!r} is not one of {SPLITS}")
        if not str(r.get("question", "")).strip() or not str(r.get("how", "")).strip():
            problems.append(f"{rid}: no question or no `how`")
        facts = r.get("facts") or []
        if not low <= len(facts) <= high:
            problems.append(f"{rid}: {len(facts)} facts, expected {low} to {high}")
        if len({f.get("id") for f in facts}) != len(facts):
            problems.append(f"{rid}: fact ids repeat")
        for f in facts:
            answers = f.get("answers") or []
            if not f.get("part") or not answers or not all(normalize_answer(a) for a in answers):
                problems.append(f"{rid}: fact {f.get('id')} lacks a part or an answer")
                continue
            if len({normalize_answer(a) for a in answers}) != len(answers):
                problems.append(f"{rid}: fact {f['id']} lists one answer twice")
            if contains_answer(r.get("question", ""), answers):
                problems.append(f"{rid}: fact {f['id']}'s answer is in the question")
            for g in facts:
                if g is not f and any(contains_answer(a, answers) for a in g.get("answers", [])):
                    problems.append(f"{rid}: fact {g['id']} states fact {f['id']}'s answer")
        if r.get("golden_answers") != [(f.get("answers") or [None])[0] for f in facts]:
            problems.append(f"{rid}: golden_answers is not each fact's answers[0]")
    tune = sum(r.get("split") == "tune" for r in records)
    if abs(2 * tune - len(records)) > 1:
        problems.append(f"splits unbalanced: {tune} tune of {len(records)}")
    return problems


def _shared_passages(
    rid: str, facts: Sequence[dict[str, Any]], corpus: Sequence[CorpusText]
) -> list[str]:
    """A problem for each passage of the corpus that states two or more of the facts."""
    held: dict[str, list[str]] = defaultdict(list)
    for f in facts:
        for c in holders(f["answers"], corpus):
            held[c.id].append(f["id"])
    return [
        f"{rid}: passage {pid} states facts {', '.join(ids)}: one passage answers them"
        for pid, ids in held.items()
        if len(ids) > 1
    ]


def loose_answers(
    records: Sequence[dict[str, Any]],
    corpus: Sequence[CorpusText],
    owners: dict[tuple[str, str], str],
) -> list[str]:
    """Answers that would match by accident: one word of three letters or fewer, a number of
    one or two digits, or one word of letters found in more than `COMMON_SHARE` of the
    passages outside the fact's own article or file (`owners`: (record id, fact id) -> it).
    A longer number (a year, a count) or a word with digits (a model name) is specific."""
    found = []
    for r in records:
        for f in r["facts"]:
            others = [c for c in corpus if c.owner != owners.get((r["id"], f["id"]))]
            for a in f["answers"]:
                words = normalize_answer(a).split()
                if len(words) != 1:
                    continue
                word = words[0]
                if (word.isdigit() and len(word) <= 2) or (word.isalpha() and len(word) <= 3):
                    found.append(f"{r['id']}: fact {f['id']}: {a!r} is too short to tell")
                elif word.isalpha() and len(holders([a], others)) > COMMON_SHARE * len(others):
                    found.append(f"{r['id']}: fact {f['id']}: {a!r} is a common word")
    return found


def wiki_findings(
    records: Sequence[dict[str, Any]],
    texts: dict[str, tuple[str, str]],
    rules: SetRules,
    indexed: dict[str, list[str]] | None = None,
) -> Findings:
    """Set (i) or (ii) against the wiki sample (`texts`: passage id -> (title, text)): every
    fact's gold verbatim and word-bounded in its passage, and whole in one of the passages the
    indexer cuts it into (`indexed`: sample id -> their texts, `indexed_texts`; unchecked when
    None), a question's facts on distinct passages of one article, no passage stating two of
    them, at most `rules.per_article` questions an article, all in one split."""
    found = Findings(problems=record_problems(records, rules))
    corpus = corpus_texts((pid, title, text) for pid, (title, text) in texts.items())
    owners: dict[tuple[str, str], str] = {}
    articles: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        rid, facts = r["id"], r["facts"]
        titles = set()
        for f in facts:
            pid = str(f.get("passage_id"))
            if pid not in texts:
                found.problems.append(f"{rid}: fact {f['id']}: no passage {pid!r} in the corpus")
                continue
            title, text = texts[pid]
            titles.add(title)
            owners[rid, f["id"]] = title
            gold = f["answers"][0]
            if gold not in text or not contains_answer(text, [gold]):
                found.problems.append(f"{rid}: fact {f['id']}: {gold!r} not in passage {pid}")
            elif indexed is not None and not _whole_in(gold, indexed.get(pid, [])):
                found.problems.append(
                    f"{rid}: fact {f['id']}: {gold!r} is in no one indexed passage of {pid}"
                )
        if len({str(f.get("passage_id")) for f in facts}) != len(facts):
            found.problems.append(f"{rid}: two facts on one passage")
        if len(titles) != 1:
            found.problems.append(f"{rid}: facts from {len(titles)} articles, expected one")
            continue
        articles[titles.pop()].append(r)
        found.problems += _shared_passages(rid, facts, corpus)
    for title, asked in articles.items():
        if len(asked) > rules.per_article:
            found.problems.append(f"{title}: {len(asked)} questions, at most {rules.per_article}")
        if len({r["split"] for r in asked}) > 1:
            found.problems.append(f"{title}: questions in both splits")
    found.loose = loose_answers(records, corpus, owners)
    return found


def article_of(record: dict[str, Any], texts: dict[str, tuple[str, str]]) -> str | None:
    """The article of a wiki or biography record's first fact (None when not in `texts`)."""
    title, _ = texts.get(str(record["facts"][0].get("passage_id")), (None, ""))
    return title


def indexed_passages(path: Path) -> list[Passage]:
    """The passages `selfrag index PATH` makes with the default settings: the project's own
    splitter, budgeted in the embedder's word pieces (only its tokenizer is read)."""
    return corpus_passages(path, RetrievalSettings(), SentenceEmbedder())


def indexed_texts(path: Path) -> dict[str, list[str]]:
    """The texts of the passages `selfrag index PATH` makes of each document, by its id (a
    wiki sample passage longer than the budget becomes two)."""
    out: dict[str, list[str]] = defaultdict(list)
    for p in indexed_passages(path):
        out[p.metadata["doc_id"]].append(p.text)
    return dict(out)


def docs_passages(repo: Path = REPO) -> list[tuple[str, str, Passage]]:
    """The passages `selfrag index README.md docs` makes of `repo` (`indexed_passages`), each
    as (its file relative to `repo`, the heading it sits under, the passage)."""
    out = []
    for name in DOCS_CORPUS:
        for p in indexed_passages(repo / name):
            rel = Path(p.metadata["source"]).resolve().relative_to(repo.resolve()).as_posix()
            out.append((rel, p.metadata.get("section", "").split(SECTION_SEPARATOR)[-1], p))
    return out


def _spaced(text: str) -> str:
    return " ".join(text.split())


def _whole_in(gold: str, texts: Iterable[str]) -> bool:
    """Whether `gold` lies whole in one of `texts` (whitespace as the splitter leaves it)."""
    return any(_spaced(gold) in _spaced(t) for t in texts)


def docs_findings(
    records: Sequence[dict[str, Any]],
    sections: dict[str, dict[str, str]],
    passages: Sequence[tuple[str, str, Passage]],
) -> Findings:
    """Set (iii) against the docs: `sections` maps each file (relative path) to its headings'
    own text (`questions.docs_sections`), `passages` are `docs_passages`. Every fact's gold
    verbatim in its file's section and whole in one passage of it; a question's facts in
    distinct sections and passages; no passage stating two of them. A section found, with the
    gold, under its heading in one other file (its file moved) is noted in `moved`; a gold no
    longer in its section is a problem."""
    found = Findings(problems=record_problems(records, DOCS_RULES))
    corpus = corpus_texts((p.id, rel, p.text) for rel, _, p in passages)
    owners: dict[tuple[str, str], str] = {}
    for r in records:
        rid, facts = r["id"], r["facts"]
        places: list[tuple[str, str]] = []
        held: list[set[str]] = []
        for f in facts:
            file, section, gold = f.get("file", ""), f.get("section", ""), f["answers"][0]
            where = file
            if gold not in sections.get(file, {}).get(section, ""):
                moved_to = [n for n, heads in sections.items() if gold in heads.get(section, "")]
                if section in sections.get(file, {}) or len(moved_to) != 1:
                    found.problems.append(
                        f"{rid}: fact {f['id']}: {gold!r} not in {file} § {section}"
                    )
                    continue
                where = moved_to[0]
                found.moved.append(f"{rid}: fact {f['id']}: § {section} is in {where}, not {file}")
            own = {
                p.id
                for rel, head, p in passages
                if rel == where and head == section and _whole_in(gold, [p.text])
            }
            if not own:
                found.problems.append(
                    f"{rid}: fact {f['id']}: {gold!r} is in no one passage of {where} § {section}"
                )
            places.append((where, section))
            held.append(own)
            owners[rid, f["id"]] = where
        if len(set(places)) != len(places):
            found.problems.append(f"{rid}: two facts in one section")
        if any(a & b for i, a in enumerate(held) for b in held[i + 1 :]):
            found.problems.append(f"{rid}: two facts in one passage")
        found.problems += _shared_passages(rid, facts, corpus)
    found.loose = loose_answers(records, corpus, owners)
    return found
