"""The hand-written question sets of bench/data hold what bench/data/README.md says: every
answer is stated where its record says it is."""

from __future__ import annotations

from bench.data.questions import DOCS, docs_problems, is_correct, load, markdown_sections


def test_every_docs_answer_is_stated_in_its_section():
    records = load(DOCS)
    assert len(records) == 30
    assert len({r["id"] for r in records}) == 30
    assert all(r["answerable"] for r in records)
    assert docs_problems(records) == []


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
