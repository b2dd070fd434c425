"""Corpus reading and passage splitting, on small files written in tmp_path."""

from __future__ import annotations

import io
import itertools
import json
import tracemalloc
from pathlib import Path

import pytest

from selfrag.infra.corpus.bounded_reads import JSONInputError, RawLine, load_json, read_lines
from selfrag.infra.corpus.reading import (
    MAX_JSON_FILE_BYTES,
    CorpusError,
    CorpusFormatError,
    Document,
    read_documents,
    source_id,
)
from selfrag.infra.corpus.splitting import split_passages
from tests.paths import ROOT

SQUAD = ROOT.parent / "shared" / "data" / "squad_v2_small.json"


def split(items: list[Document | CorpusError]) -> tuple[list[Document], list[CorpusError]]:
    docs = [item for item in items if isinstance(item, Document)]
    errors = [item for item in items if isinstance(item, CorpusError)]
    return docs, errors


def test_jsonl_reads_good_lines_and_reports_bad_ones_by_line(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    lines = [
        json.dumps({"id": "a", "title": "Alpha", "text": "First document."}).encode(),
        b'{"id": "broken", "text": ',  # corrupt JSON
        json.dumps({"id": "b", "contents": '"Beta Title"\nBeta body text.'}).encode(),
        b"",  # blank lines are not records
        json.dumps({"id": "c"}).encode(),  # no text
        b'{"id": "d", "text": "caf\xe9"}',  # Latin-1 byte: not UTF-8
        json.dumps({"text": "No id here."}).encode(),
        json.dumps({"id": 7, "text": "   "}).encode(),  # blank text
        json.dumps({"id": 8, "text": "Integer id."}).encode(),
        json.dumps({"id": "a", "text": "Same id again."}).encode(),
        b"[1, 2]",
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")

    docs, errors = split(list(read_documents(path)))

    assert [(d.id, d.title, d.text) for d in docs] == [
        ("a", "Alpha", "First document."),
        ("b", "Beta Title", "Beta body text."),
        (f"{source_id(path)}:7", None, "No id here."),
        ("8", None, "Integer id."),
    ]
    assert [e.line for e in errors] == [2, 5, 6, 8, 10, 11]
    assert all(e.path == str(path) for e in errors)
    assert "invalid JSON" in errors[0].reason
    assert "not UTF-8" in errors[2].reason
    assert "duplicate id 'a' (first at line 1)" in errors[4].reason
    assert str(errors[0]).startswith(f"{path}:2: ")


def test_flashrag_contents_without_a_quoted_title_stays_text(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    rows = [
        {"id": "1", "contents": "No title line here.\nSecond line."},
        {"id": "2", "contents": '"Quoted" but not alone on the line'},
        {"id": "3", "title": "Given", "contents": '"Ignored"\nBody.'},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    docs, errors = split(list(read_documents(path)))
    assert not errors
    assert [(d.title, d.text) for d in docs] == [
        (None, "No title line here.\nSecond line."),
        (None, '"Quoted" but not alone on the line'),
        ("Given", "Body."),
    ]


def test_jsonl_ids_are_stable_across_reads(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n', encoding="utf-8")
    first = [d.id for d in read_documents(path) if isinstance(d, Document)]
    assert first == [f"{source_id(path)}:1", f"{source_id(path)}:2"]
    assert first[0].startswith("x.jsonl@")  # readable: the file name comes first
    assert first == [d.id for d in read_documents(path) if isinstance(d, Document)]


def test_squad_paragraphs_become_documents(tmp_path: Path) -> None:
    path = tmp_path / "squad.json"
    data = {
        "version": "v2.0",
        "data": [
            {
                "title": "Big_Article",
                "paragraphs": [
                    {"context": "Paragraph zero.", "qas": []},
                    {"context": "  ", "qas": []},
                    {"context": "Paragraph two.", "qas": []},
                ],
            }
        ],
    }
    path.write_text(json.dumps(data), encoding="utf-8")
    docs, errors = split(list(read_documents(path)))
    assert [(d.id, d.title, d.text) for d in docs] == [
        ("squad:Big_Article:0", "Big Article", "Paragraph zero."),
        ("squad:Big_Article:2", "Big Article", "Paragraph two."),
    ]
    assert len(errors) == 1 and "paragraph 1" in errors[0].reason


def test_corrupt_squad_file_reports_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"data": [\n  {"title": "T",\n  oops}\n]}', encoding="utf-8")
    items = list(read_documents(path))
    assert len(items) == 1 and isinstance(items[0], CorpusError)
    assert items[0].line == 3


DEEP = "[" * 100_000 + "]" * 100_000  # past the JSON parser's recursion limit
HUGE_INT = "9" * 5000  # past Python's 4,300-digit int() limit


def test_deeply_nested_or_huge_integer_lines_are_errors_by_line(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(
        '{"id": "a", "text": "First."}\n'
        f'{{"id": "deep", "text": "x", "meta": {DEEP}}}\n'
        f'{{"id": {HUGE_INT}, "text": "x"}}\n'
        '{"id": "b", "text": "Last."}\n'
    )
    docs, errors = split(list(read_documents(path)))
    assert [d.id for d in docs] == ["a", "b"]
    assert [e.line for e in errors] == [2, 3]
    assert "nested too deeply" in errors[0].reason
    assert "more than 4300 digits" in errors[1].reason


@pytest.mark.parametrize("body", [DEEP, f'{{"data": [], "n": {HUGE_INT}}}'])
def test_a_hostile_squad_file_is_one_error(tmp_path: Path, body: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(body)
    [item] = list(read_documents(path))
    assert isinstance(item, CorpusError) and "invalid JSON" in item.reason


def test_load_json_refuses_past_max_depth_without_recursing() -> None:
    assert load_json('{"a": [1, {"b": 2}]}', max_depth=3) == {"a": [1, {"b": 2}]}
    with pytest.raises(JSONInputError, match="nested deeper than 2 levels"):
        load_json('{"a": [1, {"b": 2}]}', max_depth=2)
    deep = "[" * 800 + "]" * 800  # parses, but deeper than any reader accepts
    with pytest.raises(JSONInputError, match="nested deeper than 64"):
        load_json(deep, max_depth=64)
    with pytest.raises(JSONInputError, match="line 2, column 1") as info:
        load_json('{"a":\n}')
    assert info.value.line == 2


def test_shared_squad_file_gives_87_documents() -> None:
    docs, errors = split(list(read_documents(SQUAD)))
    assert not errors
    assert len(docs) == 87
    assert len({d.id for d in docs}) == 87
    assert docs[0].id == "squad:Normans:0" and docs[0].title == "Normans"
    assert {d.title for d in docs} == {"Normans", "Computational complexity theory"}


def test_folder_of_text_files(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "notes.txt").write_text("# not a heading in a txt\nPlain.", encoding="utf-8")
    (tmp_path / "sub" / "guide.md").write_text("Intro line\n\n## The Guide ##\nBody.", "utf-8")
    (tmp_path / "sub" / "plain.md").write_text("No heading at all.", encoding="utf-8")
    (tmp_path / "broken.md").write_bytes(b"# Fine\nline two\nbad \xff byte\n")
    (tmp_path / "empty.md").write_text("  \n", encoding="utf-8")
    (tmp_path / ".git" / "HEAD.md").write_text("hidden", encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")

    docs, errors = split(list(read_documents(tmp_path)))

    assert [(d.id, d.title) for d in docs] == [
        (source_id(tmp_path / "notes.txt"), "notes"),
        (source_id(tmp_path / "sub" / "guide.md"), "The Guide"),
        (source_id(tmp_path / "sub" / "plain.md"), "plain"),
    ]
    assert docs[1].text == "Intro line\n\n## The Guide ##\nBody."
    assert [(Path(e.path).name, e.line) for e in errors] == [
        ("broken.md", 3),
        ("empty.md", None),
        ("image.png", None),  # another format: reported with its reason, never passed over
    ]
    assert "not a format selfrag reads" in errors[2].reason


def test_single_markdown_file(tmp_path: Path) -> None:
    path = tmp_path / "one.md"
    path.write_text("# Title One\ntext", encoding="utf-8")
    assert list(read_documents(path)) == [
        Document(
            source_id(path),
            "Title One",
            "# Title One\ntext",
            source=str(path.resolve()),
            markdown=True,
        )
    ]


def test_bad_paths_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="corpus not found"):
        read_documents(tmp_path / "missing.jsonl")
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(CorpusFormatError, match="unknown corpus format"):
        read_documents(csv)
    not_squad = tmp_path / "list.json"
    not_squad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(CorpusFormatError, match="not SQuAD"):
        list(read_documents(not_squad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusFormatError, match="no"):
        read_documents(empty)


def test_short_document_is_one_passage_with_the_document_id() -> None:
    doc = Document("d1", "T", "just   a few\nwords")
    [passage] = split_passages(doc, words=10, overlap=2)
    assert passage.id == "d1"
    assert passage.text == "just a few words"
    assert passage.title == "T"
    assert passage.metadata == {"doc_id": "d1", "doc_title": "T"}


def test_long_document_is_split_into_overlapping_windows() -> None:
    words = [f"w{i}" for i in range(25)]
    doc = Document("d2", None, " ".join(words))
    passages = split_passages(doc, words=10, overlap=3)
    assert [p.id for p in passages] == ["d2#0", "d2#1", "d2#2", "d2#3"]
    assert [p.text.split() for p in passages] == [
        words[0:10],
        words[7:17],
        words[14:24],
        words[21:],
    ]
    for before, after in itertools.pairwise(passages):
        assert before.text.split()[-3:] == after.text.split()[:3]
    assert all(p.metadata == {"doc_id": "d2"} for p in passages)
    assert split_passages(doc, words=10, overlap=3) == passages  # stable


def test_exact_window_boundary_and_no_overlap() -> None:
    doc = Document("d3", None, " ".join(str(i) for i in range(20)))
    assert [p.text.split()[0] for p in split_passages(doc, 10, 0)] == ["0", "10"]
    assert [p.text.split()[0] for p in split_passages(doc, 10, 5)] == ["0", "5", "10"]
    assert split_passages(doc, 10, 5)[-1].text.split() == [str(i) for i in range(10, 20)]
    assert len(split_passages(doc, 20, 5)) == 1


@pytest.mark.parametrize(("words", "overlap"), [(0, 0), (10, 10), (10, -1)])
def test_invalid_window_parameters(words: int, overlap: int) -> None:
    with pytest.raises(ValueError):
        split_passages(Document("d", None, "text"), words, overlap)


def test_oversized_documents_are_rejected_one_by_one(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        json.dumps({"id": "small", "text": "short text"})
        + "\n"
        + json.dumps({"id": "big", "text": "word " * 200})
        + "\n"
        + json.dumps({"id": "after", "text": "still read"})
        + "\n"
    )
    items = list(read_documents(corpus, max_bytes=200))
    assert [i.id for i in items if isinstance(i, Document)] == ["small", "after"]
    (error,) = [i for i in items if isinstance(i, CorpusError)]
    assert error.line == 2 and "too large" in error.reason and "limit 200" in error.reason

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("fine")
    (folder / "b.txt").write_text("x" * 500)
    (folder / "c.txt").write_bytes(b"caf\xe9 latin-1")
    items = list(read_documents(folder, max_bytes=200))
    assert [i.id for i in items if isinstance(i, Document)] == [source_id(folder / "a.txt")]
    reasons = {Path(i.path).name: i.reason for i in items if isinstance(i, CorpusError)}
    assert "too large" in reasons["b.txt"] and "not UTF-8" in reasons["c.txt"]

    squad = tmp_path / "s.json"
    paragraphs = [{"context": "ok"}, {"context": "y" * 300}]
    squad.write_text(json.dumps({"data": [{"title": "T", "paragraphs": paragraphs}]}))
    items = list(read_documents(squad, max_bytes=200))
    assert [i.id for i in items if isinstance(i, Document)] == ["squad:T:0"]
    assert "paragraph 1" in str(next(i for i in items if isinstance(i, CorpusError)))


def test_read_lines_skips_an_over_long_line_without_keeping_it() -> None:
    data = b"abc\n" + b"x" * 25 + b"\n\n" + b"y" * 10 + b"\n" + b"z" * 11 + b"\ntail"
    assert list(read_lines(io.BytesIO(data), 10)) == [
        RawLine(1, b"abc", 3),
        RawLine(2, None, 25),
        RawLine(3, b"", 0),
        RawLine(4, b"y" * 10, 10),  # exactly the limit: the newline does not count
        RawLine(5, None, 11),
        RawLine(6, b"tail", 4),
    ]
    # An over-long last line without a newline, and a limit of one byte.
    assert list(read_lines(io.BytesIO(b"w" * 30), 10)) == [RawLine(1, None, 30)]
    assert list(read_lines(io.BytesIO(b"a\nbb\n"), 1)) == [RawLine(1, b"a", 1), RawLine(2, None, 2)]


def test_over_long_jsonl_lines_are_rejected_by_line_without_being_held(tmp_path: Path) -> None:
    limit = 200_000
    path = tmp_path / "c.jsonl"
    twice = json.dumps({"id": "twice", "text": "x" * (2 * limit)})
    huge = json.dumps({"id": "huge", "text": "y" * (10 * limit)})
    path.write_text(
        json.dumps({"id": "before", "text": "first"})
        + "\n"
        + twice
        + "\n"
        + json.dumps({"id": "after", "text": "still read"})
        + "\n"
        + huge
        + "\n"
        + json.dumps({"id": "last", "text": "no newline at the end"})
    )
    tracemalloc.start()
    try:
        items = list(read_documents(path, max_bytes=limit))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [i.id for i in items if isinstance(i, Document)] == ["before", "after", "last"]
    errors = [i for i in items if isinstance(i, CorpusError)]
    assert [(e.path, e.line) for e in errors] == [(str(path), 2), (str(path), 4)]
    assert f"({len(twice)} bytes, limit {limit}" in errors[0].reason
    assert f"({len(huge)} bytes, limit {limit}" in errors[1].reason
    # Memory follows the limit, not the line: the 2 MB line never was in memory whole
    # (a bounded readline holds up to about twice the bytes it returns).
    assert peak < 3 * limit, peak


def test_a_line_of_exactly_the_limit_is_kept(tmp_path: Path) -> None:
    line = json.dumps({"id": "edge", "text": "t"})
    path = tmp_path / "c.jsonl"
    path.write_text(line + "\n" + json.dumps({"id": "over", "text": "tt"}) + "\n")
    items = list(read_documents(path, max_bytes=len(line)))
    assert [i.id for i in items if isinstance(i, Document)] == ["edge"]
    assert [i.line for i in items if isinstance(i, CorpusError)] == [2]


def test_same_file_names_in_two_folders_get_distinct_stable_ids(tmp_path: Path) -> None:
    ids: list[str] = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        jsonl = tmp_path / folder / "corpus.jsonl"
        jsonl.write_text(json.dumps({"text": f"from {folder}"}) + "\n")
        (tmp_path / folder / "README.md").write_text(f"# {folder}\nnotes", encoding="utf-8")
        for path in (jsonl, tmp_path / folder):
            ids += [d.id for d in read_documents(path) if isinstance(d, Document)]
    assert len(ids) == len(set(ids)) == 4
    assert ids[0].startswith("corpus.jsonl@") and ids[0].endswith(":1")
    assert ids[1].startswith("README.md@")
    # Stable: the same path (however it is spelled) gives the same ids on a re-read.
    spelled = tmp_path / "b" / ".." / "a" / "corpus.jsonl"
    assert [d.id for d in read_documents(spelled) if isinstance(d, Document)] == [ids[0]]


def test_a_squad_file_over_the_bound_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "squad.json"
    paragraphs = [{"context": "Paragraph zero."}]
    path.write_text(json.dumps({"data": [{"title": "T", "paragraphs": paragraphs}]}))
    size = path.stat().st_size
    (error,) = list(read_documents(path, max_json_bytes=size - 1))
    assert isinstance(error, CorpusError) and error.line is None
    assert f"too large to parse whole ({size} bytes, limit {size - 1})" in error.reason
    assert "JSONL" in error.reason
    assert [d.id for d in read_documents(path, max_json_bytes=size)] == ["squad:T:0"]
    assert MAX_JSON_FILE_BYTES >= 64 * 2**20  # room for the SQuAD v2 train set (42 MB)


def test_indexing_keeps_same_named_files_apart_and_reports_the_oversized_line(
    llama_model: Path,
    tmp_path: Path,
) -> None:
    from selfrag.infra.embeddings.embedder import SentenceEmbedder
    from selfrag.infra.store.qdrant_store import QdrantStore
    from selfrag.jobs.indexing import index_corpus
    from selfrag.schemas.settings import RetrievalSettings

    texts = {"a": "Volcanoes erupt lava.", "b": "Sourdough bread rises."}
    for folder, text in texts.items():
        (tmp_path / folder).mkdir()
        rows = [{"text": text}, {"text": "x " * 300}]
        (tmp_path / folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with QdrantStore.open(RetrievalSettings(), tmp_path / "home", SentenceEmbedder()) as store:
        for folder in texts:
            report = index_corpus(
                tmp_path / folder / "corpus.jsonl",
                store,
                progress=False,
                retrieval=RetrievalSettings(max_document_bytes=200),
            )
            assert (report.documents, [e.line for e in report.errors]) == (1, [2])
        assert store.count() == 2
        assert store.search("lava", 1)[0].text == texts["a"]
        assert store.search("bread", 1)[0].text == texts["b"]
