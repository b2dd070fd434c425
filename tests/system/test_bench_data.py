"""The hand-written question sets of bench/data hold what bench/data/README.md says: every
answer is stated where its record says it is, unanswerable questions have none, and the SQuAD
copy of set (i) is the JSONL's. Set (i)'s passages are read from ../shared/data when present."""

from __future__ import annotations

import json

import pytest

from bench.data.questions import (
    DOCS,
    WIKI,
    WIKI_CORPUS,
    WIKI_SQUAD,
    docs_problems,
    is_correct,
    load,
    markdown_sections,
    passages,
    to_squad,
    wiki_problems,
)


def test_every_docs_answer_is_stated_in_its_section(tmp_path):
    from bench.docs_retrieval import QUESTIONS_COMMIT, snapshot

    records = load(DOCS)
    assert len(records) == 30
    assert len({r["id"] for r in records}) == 30
    assert all(r["answerable"] for r in records)
    # In the README and docs the questions were written against: the docs move on.
    assert docs_problems(records, snapshot(QUESTIONS_COMMIT, tmp_path)) == []


def test_a_docs_answer_missing_from_its_section_is_reported(tmp_path):
    (tmp_path / "README.md").write_text("# A\nthe value is FOO\n```\n# not a heading\n```\n# B\n")
    record = {"id": "x", "file": "README.md", "section": "B", "answers": ["FOO"]}
    record["golden_answers"] = record["answers"]
    assert "# not a heading" in markdown_sections((tmp_path / "README.md").read_text())["A"]
    assert docs_problems([record], tmp_path) == ["x: 'FOO' not in README.md § B"]
    assert docs_problems([{**record, "section": "A"}], tmp_path) == []
    missing = ["x: no section 'C' in README.md"]
    assert docs_problems([{**record, "section": "C"}], tmp_path) == missing


def test_scoring_credits_gold_answers_and_abstentions():
    answerable = {"answerable": True, "answers": ["1066"]}
    unanswerable = {"answerable": False, "answers": []}
    assert is_correct(answerable, "It was in 1066.", abstained=False)
    assert not is_correct(answerable, "It was in 10666.", abstained=False)
    assert not is_correct(answerable, "1066", abstained=True)
    assert is_correct(unanswerable, "", abstained=True)
    assert not is_correct(unanswerable, "1066", abstained=False)


needs_corpus = pytest.mark.skipif(not WIKI_CORPUS.exists(), reason=f"{WIKI_CORPUS} absent")


def test_the_wiki_set_is_60_questions_in_two_balanced_splits():
    records = load(WIKI)
    assert len(records) == 60
    assert len({r["id"] for r in records}) == 60
    for split in ("tune", "report"):
        part = load(WIKI, split)
        assert sum(r["answerable"] for r in part) == 15
        assert sum(not r["answerable"] for r in part) == 15
    for r in records:
        assert r["golden_answers"] == r["answers"]
        assert bool(r["answers"]) == r["answerable"]
        assert r["answerable"] or r["absence_check"]


@needs_corpus
def test_every_wiki_answer_is_in_its_passage():
    assert wiki_problems(load(WIKI), passages()) == []


@needs_corpus
def test_a_wiki_answer_not_in_its_passage_is_reported():
    texts = {"p": ("T", "It opened in 1888 in Pavia.")}
    record = {"id": "x", "answerable": True, "passage_id": "p", "answers": ["1488"]}
    record["golden_answers"] = record["answers"]
    assert wiki_problems([record], texts) == ["x: '1488' not in passage p"]
    assert wiki_problems([{**record, "answers": ["188"], "golden_answers": ["188"]}], texts)


@needs_corpus
def test_the_squad_copy_is_the_jsonl_set():
    squad = json.loads(WIKI_SQUAD.read_text(encoding="utf-8"))
    assert squad == to_squad(load(WIKI), passages())
