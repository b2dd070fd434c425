"""The hand-written question sets of bench/data hold what bench/data/README.md says: every
answer is stated where its record says it is, unanswerable questions have none, and the SQuAD
copy of set (i) is the JSONL's; every long-form question needs several passages, each holding
one of its facts. The wiki sample's passages are read from ../shared/data when present."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.data.longform import (
    LONGFORM_BIO,
    LONGFORM_DOCS,
    LONGFORM_WIKI,
    WIKI_RULES,
    Findings,
    SetRules,
    article_of,
    docs_findings,
    docs_passages,
    wiki_findings,
)
from bench.data.questions import (
    DOCS,
    WIKI,
    WIKI_CORPUS,
    WIKI_SQUAD,
    docs_problems,
    docs_sections,
    is_correct,
    load,
    longform_findings,
    markdown_sections,
    passages,
    to_squad,
    wiki_problems,
)
from selfrag.pipeline.coverage import plan_question
from selfrag.pipeline.protocols import Passage


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


# The long-form sets (issue 62), checked by bench/data/longform.py.


def test_the_long_form_docs_set_holds_every_rule_on_the_docs_as_they_are():
    assert len(load(LONGFORM_DOCS)) >= 20
    found = longform_findings(None)  # the docs set alone
    assert (found.problems, found.loose) == ([], [])


@needs_corpus
def test_the_long_form_wiki_and_biography_sets_hold_every_rule():
    texts = passages()
    wiki, bio = load(LONGFORM_WIKI), load(LONGFORM_BIO)
    assert len(wiki) >= 40 and len(bio) >= 20
    assert len({article_of(r, texts) for r in wiki}) >= 20
    found = longform_findings(texts)
    assert (found.problems, found.loose) == ([], [])


def _record(rid: str, split: str, question: str, *facts: dict[str, Any]) -> dict[str, Any]:
    """A long-form record of `facts` (their ids, parts and golden answers filled in)."""
    full = [{"id": "abc"[i], "part": f"part {i}", **f} for i, f in enumerate(facts)]
    return {
        "id": rid,
        "split": split,
        "question": question,
        "golden_answers": [f["answers"][0] for f in full],
        "facts": full,
        "how": "by hand",
    }


ARTICLES = {
    "1": ("Pavia", "The cathedral of Pavia was begun in 1488 by Cristoforo Rocchi."),
    "2": ("Pavia", "Its dome, the third largest in Italy, was completed in 1885."),
    "3": ("Pavia", "Bramante and Leonardo worked on the plans. Rocchi died in 1497."),
    "4": ("Lodi", "Lodi's cathedral was consecrated in 1158 after the city was rebuilt."),
    "5": ("Lodi", "Milan razed the old town of Lodi in 1111."),
}
BEGUN = {"answers": ["1488"], "passage_id": "1"}
DOME = {"answers": ["1885"], "passage_id": "2"}
PLANS = {"answers": ["Bramante"], "passage_id": "3"}
ASKED = "When was Pavia's cathedral begun, and when was its dome finished?"


def _problems(*records: dict[str, Any]) -> list[str]:
    return wiki_findings(records, ARTICLES, WIKI_RULES).problems


def test_a_sound_long_form_question_passes():
    razed = {"answers": ["1111"], "passage_id": "5"}
    consecrated = {"answers": ["1158"], "passage_id": "4"}
    other = _record(
        "q2", "report", "When was Lodi razed, and its cathedral consecrated?", razed, consecrated
    )
    assert wiki_findings(
        [_record("q1", "tune", ASKED, BEGUN, DOME), other], ARTICLES, WIKI_RULES
    ) == (Findings())


def test_each_broken_rule_of_a_long_form_question_is_reported():
    wrong = {**DOME, "answers": ["1886"]}
    assert _problems(
        _record("q1", "tune", ASKED, BEGUN, wrong), _record("q2", "report", ASKED, BEGUN, DOME)
    ) == [
        "q1: fact b: '1886' not in passage 2",
        "Pavia: questions in both splits",
    ]
    # Passage 3 states Rocchi besides Bramante: one passage would answer both parts.
    rocchi = {"answers": ["Cristoforo Rocchi", "Rocchi"], "passage_id": "1"}
    shared = _record("q1", "tune", "Who began it, and who planned it?", rocchi, PLANS)
    assert _problems(shared) == ["q1: passage 3 states facts a, b: one passage answers them"]
    on_one = {"answers": ["Cristoforo Rocchi"], "passage_id": "1"}
    assert "q1: two facts on one passage" in _problems(_record("q1", "tune", ASKED, BEGUN, on_one))
    told = _record("q1", "tune", "Was it begun in 1488, and when was its dome done?", BEGUN, DOME)
    assert "q1: fact a's answer is in the question" in _problems(told)
    cut = {"1": ["The cathedral of Pavia was begun in 14", "88 by Cristoforo Rocchi."]}
    indexed = cut | {"2": [ARTICLES["2"][1]]}
    record = _record("q1", "tune", ASKED, BEGUN, DOME)
    assert wiki_findings([record], ARTICLES, WIKI_RULES, indexed).problems == [
        "q1: fact a: '1488' is in no one indexed passage of 1"
    ]
    lodi = _record("q1", "tune", ASKED, BEGUN, {"answers": ["1158"], "passage_id": "4"})
    assert "q1: facts from 2 articles, expected one" in _problems(lodi)
    assert "q1: 1 facts, expected 2 to 3" in _problems(_record("q1", "tune", ASKED, BEGUN))
    two_tune = [
        _record("q1", "tune", ASKED, BEGUN, DOME),
        _record("q2", "tune", ASKED, DOME, PLANS),
    ]
    assert _problems(*two_tune) == ["splits unbalanced: 2 tune of 2"]


def test_answers_that_would_match_by_accident_are_loose():
    texts = ARTICLES | {
        f"x{i}": ("Other", f"Passage {i} is about another place.") for i in range(200)
    }
    begun = {"answers": ["1488", "88"], "passage_id": "1"}
    dome = {"answers": ["1885", "another", "the third largest"], "passage_id": "2"}
    found = wiki_findings([_record("q1", "tune", ASKED, begun, dome)], texts, SetRules((2, 3), 1))
    assert found.loose == [
        "q1: fact a: '88' is too short to tell",
        "q1: fact b: 'another' is a common word",
    ]


DOCS_README = (
    "# Tool\n\nInstall it with `make install`.\n\n## Settings\n\nThe home is `TOOL_HOME`.\n"
)
DOCS_GUIDE = (
    "# Guide\n\n## Serving\n\nThe server listens on port 8420.\n\n"
    "## Logs\n\nLogs go to `/var/log/tool`.\n"
)


@pytest.fixture
def docs_repo(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(DOCS_README)
    (tmp_path / "docs" / "guide.md").write_text(DOCS_GUIDE)
    return tmp_path


def _docs_problems(repo: Path, *facts: dict[str, Any]) -> Findings:
    record = _record("d1", "tune", "How do I set it up and run it?", *facts)
    return docs_findings([record], docs_sections(repo), docs_passages(repo))


HOME = {"answers": ["TOOL_HOME"], "file": "README.md", "section": "Settings"}
PORT = {"answers": ["8420"], "file": "docs/guide.md", "section": "Serving"}


def test_a_docs_question_is_checked_against_the_projects_own_passages(docs_repo):
    assert _docs_problems(docs_repo, HOME, PORT) == Findings()
    logs = {"answers": ["/var/log/tool"], "file": "docs/guide.md", "section": "Serving"}
    assert _docs_problems(docs_repo, HOME, logs).problems == [
        "d1: fact b: '/var/log/tool' not in docs/guide.md § Serving"
    ]
    port_again = {"answers": ["port 8420"], "file": "docs/guide.md", "section": "Serving"}
    assert "d1: two facts in one section" in _docs_problems(docs_repo, PORT, port_again).problems


def test_a_docs_file_that_moved_is_a_note_and_a_fact_that_left_its_section_a_problem(docs_repo):
    (docs_repo / "docs" / "guide.md").rename(docs_repo / "docs" / "serving.md")
    found = _docs_problems(docs_repo, HOME, PORT)
    assert found.problems == []
    assert found.moved == ["d1: fact b: § Serving is in docs/serving.md, not docs/guide.md"]
    (docs_repo / "docs" / "serving.md").write_text(DOCS_GUIDE.replace("8420", "8421"))
    assert _docs_problems(docs_repo, HOME, PORT).problems == [
        "d1: fact b: '8420' not in docs/guide.md § Serving"
    ]


def test_a_docs_fact_cut_between_two_passages_is_reported():
    sections = {"README.md": {"Settings": "The home is TOOL_HOME by default."}}
    cut = [
        ("README.md", "Settings", Passage(id="r#0", text="The home is TOOL_")),
        ("README.md", "Settings", Passage(id="r#1", text="HOME by default.")),
    ]
    home = {"answers": ["TOOL_HOME"], "file": "README.md", "section": "Settings"}
    other = {"answers": ["make install"], "file": "README.md", "section": "Install"}
    record = _record("d1", "tune", "Where is its home?", home, other)
    found = docs_findings(
        [record], sections | {"README.md": sections["README.md"] | {"Install": "make install"}}, cut
    )
    assert "d1: fact a: 'TOOL_HOME' is in no one passage of README.md § Settings" in found.problems


def test_the_planner_cuts_each_long_form_question_into_its_facts_and_no_short_one():
    """`coverage.plan_question` on the sets as written: a long-form question listing parts
    plans one part per fact, a biography without a list an open account; a question of the
    short-answer sets (and of the shared SQuAD sample, when present) asks one thing."""
    for path in (LONGFORM_WIKI, LONGFORM_BIO, LONGFORM_DOCS):
        for r in load(path):
            plan = plan_question(r["question"])
            assert len(plan.parts) == len(r["facts"]) or (
                path == LONGFORM_BIO and plan.open_ended
            ), r["id"]
    short = [r["question"] for path in (WIKI, DOCS) for r in load(path)]
    squad = WIKI_CORPUS.parent / "squad_v2_small.json"
    if squad.exists():
        data = json.loads(squad.read_text(encoding="utf-8"))["data"]
        short += [q["question"] for a in data for p in a["paragraphs"] for q in p["qas"]]
    assert [q for q in short if plan_question(q).long] == []
