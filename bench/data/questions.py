"""Hand-written question sets of bench/data: loading, checking and scoring.

`wiki_questions.jsonl` (passages of `../shared/data/wiki_sample_1000.jsonl`),
`docs_questions.jsonl` (this repository's README.md and docs/) and the long-form sets
`longform_{wiki,bio,docs}.jsonl` (bench.data.longform checks them) are described in
bench/data/README.md. `selfrag eval` reads the JSONL files directly (their `golden_answers`);
`--article wiki_tune|wiki_report` on `wiki_questions.squad.json` picks one split of set (i).

    .venv/bin/python -m bench.data.questions squad   # rewrite wiki_questions.squad.json
    .venv/bin/python -m bench.data.questions check   # every answer found where it is claimed
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.data.longform import (
    BIO_RULES,
    HERE,
    LONGFORM_BIO,
    LONGFORM_DOCS,
    LONGFORM_WIKI,
    REPO,
    SPLITS,
    WIKI_RULES,
    Findings,
    article_of,
    docs_findings,
    docs_passages,
    indexed_texts,
    wiki_findings,
)
from bench.docs_retrieval import QUESTIONS_COMMIT, snapshot
from selfrag.pipeline.evaluation.qa_metrics import contains_answer

WIKI = HERE / "wiki_questions.jsonl"
WIKI_SQUAD = HERE / "wiki_questions.squad.json"
DOCS = HERE / "docs_questions.jsonl"
WIKI_CORPUS = REPO.parent / "shared" / "data" / "wiki_sample_1000.jsonl"

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def load(path: Path, split: str | None = None) -> list[dict[str, Any]]:
    """The records of a question file, optionally one split ("tune" or "report")."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {SPLITS}")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [r for r in records if split is None or r.get("split") == split]


def is_correct(record: dict[str, Any], answer: str, abstained: bool) -> bool:
    """Right when an answerable question is answered with a gold answer (SQuAD-normalised,
    word-bounded, as `selfrag eval` scores) or an unanswerable one is abstained on."""
    if not record["answerable"]:
        return abstained
    return not abstained and contains_answer(answer, record["answers"])


def passages(corpus: Path = WIKI_CORPUS) -> dict[str, tuple[str, str]]:
    """The wiki sample's passages by id, as (title, text)."""
    out: dict[str, tuple[str, str]] = {}
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            title, _, text = rec["contents"].partition("\n")
            out[str(rec["id"])] = (title.strip('"'), text)
    return out


def markdown_sections(text: str) -> dict[str, str]:
    """Each heading's own text (up to the next heading of any level; fenced code is text)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    in_fence = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        match = None if in_fence else _HEADING.match(line)
        if match:
            current = sections.setdefault(match.group(2), [])
        elif current is not None:
            current.append(line)
    return {heading: "\n".join(lines) for heading, lines in sections.items()}


def docs_sections(repo: Path = REPO) -> dict[str, dict[str, str]]:
    """Each Markdown file `selfrag index README.md docs` reads (path relative to `repo`) with
    its headings' own text (`markdown_sections`)."""
    files = [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]
    return {
        f.relative_to(repo).as_posix(): markdown_sections(f.read_text(encoding="utf-8"))
        for f in files
        if f.is_file()
    }


def to_squad(records: Sequence[dict[str, Any]], texts: dict[str, tuple[str, str]]) -> dict:
    """SQuAD v2 JSON of set (i): one article per split (`wiki_tune`, `wiki_report`), one
    paragraph per passage (the passage's text; an unanswerable question sits on its near
    passage with `is_impossible`)."""
    data = []
    for split in SPLITS:
        paragraphs: dict[str, dict[str, Any]] = {}
        for r in records:
            if r["split"] != split:
                continue
            pid = r["passage_id"] if r["answerable"] else r["near_passage_id"]
            context = texts[pid][1]
            para = paragraphs.setdefault(pid, {"context": context, "qas": []})
            answers = [{"text": a, "answer_start": context.index(a)} for a in r["answers"]]
            para["qas"].append(
                {
                    "id": r["id"],
                    "question": r["question"],
                    "answers": answers,
                    "is_impossible": not r["answerable"],
                }
            )
        data.append({"title": f"wiki_{split}", "paragraphs": list(paragraphs.values())})
    return {"version": "v2.0", "data": data}


def wiki_problems(
    records: Iterable[dict[str, Any]], texts: dict[str, tuple[str, str]]
) -> list[str]:
    """What is wrong with set (i) against the corpus (empty when all holds)."""
    problems = []
    for r in records:
        rid = r["id"]
        if r["golden_answers"] != r["answers"]:
            problems.append(f"{rid}: golden_answers differs from answers")
        if not r["answerable"]:
            if r["answers"]:
                problems.append(f"{rid}: unanswerable with answers")
            if r["near_passage_id"] not in texts:
                problems.append(f"{rid}: near passage {r['near_passage_id']} not in the corpus")
            continue
        if not r["answers"]:
            problems.append(f"{rid}: answerable without answers")
        text = texts.get(r["passage_id"], ("", ""))[1]
        for a in r["answers"]:
            if a not in text or not contains_answer(text, [a]):
                problems.append(f"{rid}: {a!r} not in passage {r['passage_id']}")
    return problems


def docs_problems(records: Iterable[dict[str, Any]], repo: Path = REPO) -> list[str]:
    """Each docs answer must be stated, verbatim, in its file's named section."""
    problems = []
    for r in records:
        path = repo / r["file"]
        if not path.exists():
            problems.append(f"{r['id']}: no file {r['file']}")
            continue
        body = markdown_sections(path.read_text(encoding="utf-8")).get(r["section"])
        if body is None:
            problems.append(f"{r['id']}: no section {r['section']!r} in {r['file']}")
            continue
        if r["golden_answers"] != r["answers"] or not r["answers"]:
            problems.append(f"{r['id']}: answers missing or differ from golden_answers")
        for a in r["answers"]:
            if a not in body:
                problems.append(f"{r['id']}: {a!r} not in {r['file']} § {r['section']}")
    return problems


def longform_findings(
    texts: dict[str, tuple[str, str]] | None, repo: Path = REPO, corpus: Path = WIKI_CORPUS
) -> Findings:
    """The long-form sets checked (bench.data.longform): the docs set against `repo`'s README.md
    and docs/, the wiki and biography sets against `texts`, the passages of `corpus` (skipped
    when None), which share no article."""
    found = docs_findings(load(LONGFORM_DOCS), docs_sections(repo), docs_passages(repo))
    if texts is not None:
        wiki, bio, indexed = load(LONGFORM_WIKI), load(LONGFORM_BIO), indexed_texts(corpus)
        found.add(wiki_findings(wiki, texts, WIKI_RULES, indexed))
        found.add(wiki_findings(bio, texts, BIO_RULES, indexed))
        both = {article_of(r, texts) for r in wiki} & {article_of(r, texts) for r in bio}
        found.problems += [f"{a}: in both the wiki and the biography sets" for a in sorted(both)]
    return found


def longform_counts(path: Path, texts: dict[str, tuple[str, str]] | None) -> str:
    """One line on a long-form set: questions per split, facts, articles (or files)."""
    records = load(path)
    tune = sum(r["split"] == "tune" for r in records)
    facts = sum(len(r["facts"]) for r in records)
    if "passage_id" in records[0]["facts"][0]:
        where = f"{len({article_of(r, texts) for r in records})} articles" if texts else ""
    else:
        where = f"{len({f['file'] for r in records for f in r['facts']})} files"
    return (
        f"{path.name}: {len(records)} questions ({tune} tune, {len(records) - tune} report), "
        f"{facts} facts, {where}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("squad", "check"))
    p.add_argument("--corpus", type=Path, default=WIKI_CORPUS)
    args = p.parse_args(argv)
    texts = passages(args.corpus) if args.corpus.exists() else None
    if args.command == "squad":
        if texts is None or not WIKI.exists():
            p.error(f"needs {args.corpus} and {WIKI}")
        squad = json.dumps(to_squad(load(WIKI), texts), indent=1, ensure_ascii=False)
        WIKI_SQUAD.write_text(squad + "\n", encoding="utf-8")
        print(f"wrote {WIKI_SQUAD}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:  # the docs the short-answer set was written on
        problems = docs_problems(load(DOCS), snapshot(QUESTIONS_COMMIT, Path(tmp)))
    if texts is not None:
        problems += wiki_problems(load(WIKI), texts)
    else:
        print(f"{args.corpus} absent: the sets over it not checked", file=sys.stderr)
    found = longform_findings(texts, corpus=args.corpus)
    for line in problems + found.problems:
        print(line, file=sys.stderr)
    for line in found.loose:
        print(f"loose answer: {line}", file=sys.stderr)
    for line in found.moved:
        print(f"moved (update the record): {line}", file=sys.stderr)
    for path in (LONGFORM_WIKI, LONGFORM_BIO, LONGFORM_DOCS):
        print(longform_counts(path, texts))
    failed = len(problems) + len(found.problems)
    print(f"problems={failed} loose={len(found.loose)} moved={len(found.moved)}")
    return 1 if failed or found.loose else 0


if __name__ == "__main__":
    raise SystemExit(main())
