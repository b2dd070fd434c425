"""Documents in and out of the index: structure-aware passages, PDF and HTML files, what a
folder read refuses (links out of the folder, special files), listing and removing
documents, and re-indexing a folder that lost a file."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from selfrag.infra.corpus.passages import CHARS_PER_PIECE, markdown_blocks
from selfrag.infra.corpus.reading import CorpusError, Document, read_documents
from selfrag.infra.corpus.splitting import split_document
from selfrag.infra.embeddings.embedder import SentenceEmbedder
from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.jobs.indexing import PieceCounter, corpus_passages, index_corpus
from selfrag.schemas.documents import DocumentInfo, Removal
from selfrag.schemas.settings import RetrievalSettings
from tests.corpus_files import HTML_PAGE, write_pdf
from tests.fakes import HashEmbedder

MARKDOWN = """# Guide

Intro paragraph about the guide.

## Embeddings

selfrag embeds passages with all-MiniLM-L6-v2.

```python
vectors = embed(["a", "b"])
print(vectors.shape)
```

| setting | default |
| --- | --- |
| hybrid | true |

### Sparse

BM25 runs beside the dense vectors.
"""


def _count(text: str) -> int:
    return len(text.split())


def split(items: list[Document | CorpusError]) -> tuple[list[Document], list[CorpusError]]:
    docs = [i for i in items if isinstance(i, Document)]
    return docs, [i for i in items if isinstance(i, CorpusError)]


# --- passages by structure ------------------------------------------------------------------


def test_markdown_passages_keep_their_section_path_and_whole_code_and_tables() -> None:
    doc = Document("g", "Guide", MARKDOWN, markdown=True)
    passages = split_document(doc, budget=30, count=_count)
    by_title: dict[str | None, list[str]] = {}
    for p in passages:
        by_title.setdefault(p.title, []).append(p.text)
    assert by_title["Guide"] == ["Intro paragraph about the guide."]
    embeddings = "\n\n".join(by_title["Guide › Embeddings"])
    # The code block and the table are each whole, with their line breaks.
    assert '```python\nvectors = embed(["a", "b"])\nprint(vectors.shape)\n```' in embeddings
    assert "| setting | default |\n| --- | --- |\n| hybrid | true |" in embeddings
    assert by_title["Guide › Embeddings › Sparse"] == ["BM25 runs beside the dense vectors."]
    # Headings are in the titles, not the text; no passage mixes two sections.
    assert not any(p.text.startswith("#") for p in passages)
    assert {p.metadata["section"] for p in passages} >= {"Guide › Embeddings"}


def test_a_block_over_the_budget_is_cut_at_sentences() -> None:
    text = " ".join(f"Sentence number {i} ends here." for i in range(20))
    doc = Document("d", None, text)
    passages = split_document(doc, budget=12, count=_count)
    assert len(passages) > 1
    for p in passages:
        assert _count(p.text) <= 12
        assert p.text.endswith("here.")  # whole sentences while they fit
    assert [p.id for p in passages] == [f"d#{i}" for i in range(len(passages))]


@pytest.mark.real
def test_one_unspaced_run_becomes_passages_bounded_in_word_pieces(tmp_path: Path) -> None:
    """At index time, `"a." * 40000` plus a sentence becomes passages bounded in word pieces,
    not one passage of 80,000 tokens that no prompt could hold. Cut as indexing cuts
    (`corpus_passages`), with the real embedder's word pieces."""
    embedder = SentenceEmbedder()
    settings = RetrievalSettings()
    budget = min(settings.passage_tokens, embedder.max_seq_length - 2)
    path = tmp_path / "run.jsonl"
    rows = [
        {"id": "run", "text": "a." * 40000 + " The volcano erupted in 1902."},
        {"id": "unk", "text": "x" * 5000},  # one word of 5000 characters: one [UNK] piece
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    passages = corpus_passages(path, settings, embedder)
    assert len(passages) > 300
    for p in passages:
        assert embedder.count_pieces(p.text) <= budget, p.id
        assert len(p.text) <= budget * CHARS_PER_PIECE
    assert any("volcano erupted" in p.text for p in passages)
    assert {p.metadata["doc_id"] for p in passages} == {"run", "unk"}


def test_piece_counter_counts_each_word_once() -> None:
    calls: list[str] = []

    def count(word: str) -> int:
        calls.append(word)
        return len(word)

    counter = PieceCounter(count)
    assert counter("ab ab abc") == 7
    assert counter("abc") == 3
    assert calls == ["ab", "abc"]


def test_markdown_blocks_end_a_section_at_a_heading_of_the_same_level() -> None:
    blocks = markdown_blocks("# A\n\none\n\n## B\n\ntwo\n\n## C\n\nthree\n\n# D\n\nfour")
    assert [(b.section, b.text) for b in blocks] == [
        (("A",), "one"),
        (("A", "B"), "two"),
        (("A", "C"), "three"),
        (("D",), "four"),
    ]


# --- PDF and HTML --------------------------------------------------------------------------


def test_a_pdf_is_read_page_by_page(tmp_path: Path) -> None:
    pdf = write_pdf(
        tmp_path / "report.pdf",
        [["Normandy lies in France.", "Its capital is Rouen."], ["Rollo founded it in 911."]],
        title="Normandy Report",
    )
    [doc] = list(read_documents(pdf))
    assert isinstance(doc, Document)
    assert doc.title == "Normandy Report"
    passages = split_document(doc, budget=200, count=_count)
    assert [(p.metadata["page"], p.text) for p in passages] == [
        ("1", "Normandy lies in France. Its capital is Rouen."),
        ("2", "Rollo founded it in 911."),
    ]


def test_pdfs_without_text_or_broken_are_reported_with_their_reason(tmp_path: Path) -> None:
    write_pdf(tmp_path / "scan.pdf", [[]])
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\nthis is not a pdf at all")
    (tmp_path / "fine.pdf").write_bytes(write_pdf(tmp_path / "x.pdf", [["Text."]]).read_bytes())
    (tmp_path / "x.pdf").unlink()
    docs, errors = split(list(read_documents(tmp_path)))
    assert [Path(d.source or "").name for d in docs] == ["fine.pdf"]
    reasons = {Path(e.path).name: e.reason for e in errors}
    assert "no text layer" in reasons["scan.pdf"]
    assert "unreadable PDF" in reasons["broken.pdf"] or "no text layer" in reasons["broken.pdf"]


def test_html_main_content_title_and_own_url(tmp_path: Path) -> None:
    page = tmp_path / "lava.html"
    page.write_text(HTML_PAGE, encoding="utf-8")
    [doc] = list(read_documents(page))
    assert isinstance(doc, Document)
    assert (doc.title, doc.url) == ("Lava Guide", "https://example.org/lava")
    for noise in ("tracking", "Site navigation", "Site banner", "Copyright footer"):
        assert noise not in doc.text
    passages = split_document(doc, budget=200, count=_count)
    titles = [p.title for p in passages]
    assert titles == ["Lava Guide", "Lava Guide › Cooling"]
    assert "cool(lava)\n  -> basalt" in passages[1].text
    assert "Rock | Silica\nBasalt | low" in passages[1].text
    assert all(p.metadata["url"] == "https://example.org/lava" for p in passages)


def test_html_with_a_script_url_keeps_no_url(tmp_path: Path) -> None:
    page = tmp_path / "p.html"
    page.write_text(
        '<html><head><link rel="canonical" href="javascript:alert(1)"></head>'
        "<body><p>Plain text.</p></body></html>",
        encoding="utf-8",
    )
    [doc] = list(read_documents(page))
    assert isinstance(doc, Document) and doc.url is None and doc.title == "p"


# --- what a folder read refuses -------------------------------------------------------------


def test_a_link_out_of_the_folder_is_reported_and_not_read(tmp_path: Path) -> None:
    corpus, outside = tmp_path / "corpus", tmp_path / "outside"
    corpus.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("API_KEY=hunter2", encoding="utf-8")
    (corpus / "ok.txt").write_text("Plain notes.", encoding="utf-8")
    (corpus / "env.txt").symlink_to("/proc/self/environ")
    (corpus / "leak.txt").symlink_to(outside / "secret.txt")
    (corpus / "more").symlink_to(outside, target_is_directory=True)
    (corpus / "inside.txt").symlink_to(corpus / "ok.txt")  # stays inside: read once, as ok.txt

    docs, errors = split(list(read_documents(corpus)))
    assert [d.text for d in docs] == ["Plain notes."]
    reasons = {Path(e.path).name: e.reason for e in errors}
    assert set(reasons) == {"env.txt", "leak.txt", "more"}
    assert "pseudo filesystem" in reasons["env.txt"]
    assert "outside the folder" in reasons["leak.txt"] and "--follow-links" in reasons["leak.txt"]

    # Allowed on request, except into a pseudo filesystem.
    docs, errors = split(list(read_documents(corpus, follow_links=True)))
    assert sorted(d.text for d in docs) == ["API_KEY=hunter2", "API_KEY=hunter2", "Plain notes."]
    assert [Path(e.path).name for e in errors] == ["env.txt"]


def test_special_files_are_never_read(tmp_path: Path) -> None:
    (tmp_path / "ok.md").write_text("Fine.", encoding="utf-8")
    os.mkfifo(tmp_path / "pipe.txt")
    result: list[list[Document | CorpusError]] = []
    reader = threading.Thread(target=lambda: result.append(list(read_documents(tmp_path))))
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader so the test ends, then fail
        with open(tmp_path / "pipe.txt", "wb"):
            pass
        pytest.fail("reading the folder blocked on a FIFO")
    docs, errors = split(result[0])
    assert [d.text for d in docs] == ["Fine."]
    assert [(Path(e.path).name, "not a regular file" in e.reason) for e in errors] == [
        ("pipe.txt", True)
    ]
    with pytest.raises(ValueError, match="not a regular file"):
        read_documents(tmp_path / "pipe.txt")


# --- documents in the store ------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[QdrantStore]:
    with QdrantStore.open(RetrievalSettings(), tmp_path / "home", HashEmbedder()) as opened:
        yield opened


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "notes.txt").write_text("Notes about lava.\n\nMore notes.", encoding="utf-8")
    (folder / "guide.md").write_text(MARKDOWN, encoding="utf-8")
    write_pdf(folder / "paper.pdf", [["Page one."], ["Page two."]], title="Paper")
    return folder


def test_documents_are_listed_removed_and_gone_ones_leave_on_reindex(
    store: QdrantStore, tmp_path: Path
) -> None:
    folder = _folder(tmp_path)
    report = index_corpus(folder, store, progress=False)
    assert (report.documents, report.removed) == (3, 0)
    docs = {Path(d.source or "").name: d for d in store.documents()}
    assert set(docs) == {"notes.txt", "guide.md", "paper.pdf"}
    assert docs["paper.pdf"].title == "Paper" and docs["paper.pdf"].passages == 2
    assert docs["guide.md"].title == "Guide" and (docs["guide.md"].indexed_at or "") >= "2026"
    assert sum(d.passages for d in docs.values()) == store.count()

    # A file deleted from the folder: re-indexing takes its document out, and says so.
    (folder / "notes.txt").unlink()
    version = store.index_version()
    report = index_corpus(folder, store, progress=False)
    assert (report.documents, report.unchanged) == (0, 2)  # read again, not embedded again
    assert (report.removed, report.removed_passages) == (1, 1)
    assert {Path(d.source or "").name for d in store.documents()} == {"guide.md", "paper.pdf"}
    assert store.index_version() != version
    assert not [p for p in store.passages() if "Notes about lava" in p.text]

    # Removal by id and by path; a ref that names nothing is reported, not an error.
    version = store.index_version()
    removal = store.remove([docs["paper.pdf"].id, str(folder / "guide.md"), "nope"])
    assert sorted(removal.documents) == sorted([docs["paper.pdf"].id, docs["guide.md"].id])
    assert removal.unmatched == ["nope"]
    assert removal.passages > 0 and store.count() == 0 and store.documents() == []
    assert store.index_version() != version


def test_an_index_run_lists_the_stores_documents_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documents listed before the read serve both the unchanged ones it skips and the
    gone ones it removes."""
    folder = _folder(tmp_path)
    with QdrantStore.open(RetrievalSettings(), tmp_path / "home", HashEmbedder()) as store:
        index_corpus(folder, store, progress=False)
        (folder / "notes.txt").unlink()
        listings: list[int] = []
        listed = store.documents
        monkeypatch.setattr(store, "documents", lambda: listings.append(1) or listed())
        report = index_corpus(folder, store, progress=False)
        assert (report.unchanged, report.removed) == (2, 1) and len(listings) == 1


class CountingEmbedder(HashEmbedder):
    """A `HashEmbedder` that counts the texts it embeds."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def embed(self, texts: Any) -> Any:
        self.texts.extend(texts)
        return super().embed(texts)


def test_only_new_or_changed_documents_are_embedded_again(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    embedder = CountingEmbedder()
    with QdrantStore.open(RetrievalSettings(), tmp_path / "home", embedder) as store:
        first = index_corpus(folder, store, progress=False)
        assert first.unchanged == 0 and len(embedder.texts) == first.passages
        digests = {d.id: d.digest for d in store.documents()}
        assert all(digests.values())
        version, embedder.texts = store.index_version(), []

        again = index_corpus(folder, store, progress=False)
        assert (again.documents, again.passages, again.unchanged) == (0, 0, 3)
        assert embedder.texts == [] and store.index_version() == version  # caches stay valid

        (folder / "notes.txt").write_text("Notes about basalt.", encoding="utf-8")
        changed = index_corpus(folder, store, progress=False)
        assert (changed.documents, changed.unchanged) == (1, 2)
        assert embedder.texts == ["Notes about basalt."]
        after = {d.id: d.digest for d in store.documents()}
        assert [i for i in after if after[i] != digests[i]] == [
            d.id for d in store.documents() if d.source and d.source.endswith("notes.txt")
        ]
        assert store.index_version() != version


def test_an_interrupted_ray_index_goes_on_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`index --ray` writes chunk by chunk; a rerun embeds only what the killed run had not
    written (the embedding on Ray replaced by this process's embedder: the resume is what
    is tested; tests/system/test_cluster.py and the test below run the real Ray path)."""
    import selfrag.jobs.ray_indexing as job
    import selfrag.jobs.ray_pool as pool

    folder = _folder(tmp_path)
    embedder = CountingEmbedder()
    calls = {"n": 0, "fail_at": 2}

    def embed(texts: list[str], model: Any, dim: int, **_: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise KeyboardInterrupt  # the run killed mid-way
        return embedder.embed(texts)

    monkeypatch.setattr(job, "embed_on_ray", embed)
    monkeypatch.setattr(pool, "ensure_ray", lambda address: False)
    settings = RetrievalSettings()
    with QdrantStore.open(settings, tmp_path / "home", embedder) as store:
        with pytest.raises(KeyboardInterrupt):
            job.index_corpus_ray(folder, store, retrieval=settings, chunk_passages=1)
        assert len(store.documents()) == 1  # the first chunk: one whole document
        embedded = len(embedder.texts)
        calls["fail_at"] = 0
        report = job.index_corpus_ray(folder, store, retrieval=settings, chunk_passages=1)
        assert (report.documents, report.unchanged) == (2, 1)
        assert len(store.documents()) == 3
        assert len(embedder.texts) - embedded == report.passages  # nothing embedded twice


def test_a_file_that_fails_to_read_keeps_its_old_document(
    store: QdrantStore, tmp_path: Path
) -> None:
    folder = _folder(tmp_path)
    index_corpus(folder, store, progress=False)
    (folder / "notes.txt").write_bytes(b"bad \xff byte")
    report = index_corpus(folder, store, progress=False)
    assert report.removed == 0 and len(report.errors) == 1
    assert "notes.txt" in {Path(d.source or "").name for d in store.documents()}


def test_removing_a_folder_leaves_other_corpora(store: QdrantStore, tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "keep", "text": "Kept."}) + "\n", encoding="utf-8")
    index_corpus(folder, store, progress=False)
    index_corpus(other, store, progress=False)
    removal = store.remove([str(folder)])
    assert len(removal.documents) == 3
    assert [d.id for d in store.documents()] == ["keep"]
    # A record dropped from a JSONL file is removed on its re-index too.
    other.write_text(json.dumps({"id": "new", "text": "New."}) + "\n", encoding="utf-8")
    assert index_corpus(other, store, progress=False).removed == 1
    assert [d.id for d in store.documents()] == ["new"]


def test_a_removal_lasts_after_a_restart(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    settings, home = RetrievalSettings(), tmp_path / "home"
    with QdrantStore.open(settings, home, HashEmbedder()) as store:
        index_corpus(folder, store, progress=False)
        store.remove([str(folder / "notes.txt")])
        version = store.index_version()
    with QdrantStore.open(settings, home, HashEmbedder()) as store:
        assert "notes.txt" not in {Path(d.source or "").name for d in store.documents()}
        assert not [p for p in store.passages() if "lava" in p.text.lower()]
        assert store.index_version() == version


# --- the CLI ---------------------------------------------------------------------------------


@pytest.mark.real
def test_cli_docs_list_rm_and_reindex_removal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from selfrag.cli import main

    folder = _folder(tmp_path)
    (folder / "evil.txt").write_text("Title with \x1b]0;PWNED\x07 escape.", encoding="utf-8")
    home = ["--home", str(tmp_path / "home")]
    index = [*home, "index", "--no-progress", "--no-calibrate"]
    assert main([*index, str(folder)]) == 0
    capsys.readouterr()
    assert main([*home, "docs", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {Path(d["source"]).name for d in listed} == {
        "notes.txt",
        "guide.md",
        "paper.pdf",
        "evil.txt",
    }
    assert main([*home, "docs", "list"]) == 0
    table = capsys.readouterr().out
    assert "\x1b" not in table and "4 documents" in table

    (folder / "notes.txt").unlink()
    assert main([*index, str(folder)]) == 0
    assert "1 removed (1 passages: gone from it" in capsys.readouterr().out

    paper = next(d["id"] for d in listed if d["source"].endswith("paper.pdf"))
    assert main([*home, "docs", "rm", paper, str(folder / "guide.md"), "nothing-here"]) == 1
    out = capsys.readouterr().out
    assert "removed 2 documents" in out and "no indexed document is nothing-here" in out
    assert main([*home, "docs", "list", "--json"]) == 0
    assert [Path(d["source"]).name for d in json.loads(capsys.readouterr().out)] == ["evil.txt"]

    # Another collection in the same home is kept apart.
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "o", "text": "Other corpus."}) + "\n", encoding="utf-8")
    assert main([*index, "--collection", "second", str(other)]) == 0
    capsys.readouterr()
    assert main([*home, "docs", "list", "--json", "--collection", "second"]) == 0
    assert [d["id"] for d in json.loads(capsys.readouterr().out)] == ["o"]
    assert main([*home, "docs", "list", "--json"]) == 0
    assert [Path(d["source"]).name for d in json.loads(capsys.readouterr().out)] == ["evil.txt"]


# --- HTTP ------------------------------------------------------------------------------------


class StoreDocuments:
    """The document routes' service over a real store (the ingress calls the Retriever's)."""

    def __init__(self, store: QdrantStore) -> None:
        self.store = store

    async def documents(self) -> list[DocumentInfo]:
        return self.store.documents()

    async def remove(self, refs: list[str]) -> Removal:
        return self.store.remove(refs)


def test_http_lists_and_removes_documents_with_the_api_key(
    store: QdrantStore, tmp_path: Path
) -> None:
    from urllib.parse import quote

    from fastapi.testclient import TestClient

    from selfrag.actors.http.metrics import Metrics
    from selfrag.actors.http.routes import build_http_app, parse_api_keys
    from tests.http_fakes import FakeService

    folder = _folder(tmp_path)
    index_corpus(folder, store, progress=False)
    docs = StoreDocuments(store)
    keys = parse_api_keys("k1")
    client = TestClient(build_http_app(FakeService(), Metrics(), api_keys=keys, documents=docs))
    auth = {"Authorization": "Bearer k1"}
    assert client.get("/v1/documents").status_code == 401
    listed = client.get("/v1/documents", headers=auth)
    assert listed.status_code == 200
    by_name = {Path(d["source"]).name: d for d in listed.json()}
    assert set(by_name) == {"notes.txt", "guide.md", "paper.pdf"}

    paper = by_name["paper.pdf"]["id"]  # "paper.pdf@<hash>": encoded as a path segment
    assert client.delete(f"/v1/documents/{quote(paper, safe='')}").status_code == 401
    gone = client.delete(f"/v1/documents/{quote(paper, safe='')}", headers=auth)
    assert gone.status_code == 200 and gone.json()["documents"] == [paper]
    assert gone.json()["passages"] == 2
    missing = client.delete("/v1/documents/no-such-doc", headers=auth)
    assert missing.status_code == 404 and "no-such-doc" in missing.text
    assert {d["id"] for d in client.get("/v1/documents", headers=auth).json()} == {
        by_name["notes.txt"]["id"],
        by_name["guide.md"]["id"],
    }

    # Without API keys nothing can remove documents over HTTP; listing stays open as /v1 is.
    open_client = TestClient(build_http_app(FakeService(), Metrics(), documents=docs))
    refused = open_client.delete(f"/v1/documents/{quote(by_name['guide.md']['id'], safe='')}")
    assert refused.status_code == 403 and "SELFRAG_API_KEYS" in refused.text
    assert len(open_client.get("/v1/documents").json()) == 2


# --- answers after a removal (the real model) -------------------------------------------------


@pytest.mark.real
def test_no_answer_cites_a_removed_document_even_cached_or_after_a_restart(
    tmp_path: Path,
) -> None:
    from selfrag import SelfRAG

    corpus = tmp_path / "c.jsonl"
    rows = [
        {"id": "rollo", "title": "Rollo", "text": "Rollo, a Viking leader, founded Normandy."},
        {"id": "apples", "title": "Apples", "text": "Normandy grows apples for its cider."},
    ]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    dials = {"mode": "always", "top_k": 2, "max_segments": 1, "max_segment_tokens": 8}
    dials |= {"min_relevance": 0.0, "min_support_score": 0.0}
    question = "Who founded Normandy?"

    def cites(r: Any) -> set[str]:
        return {p.id for p in r.passages} | {
            s.citation.passage_id for s in r.segments if s.citation is not None
        }

    home = tmp_path / "home"
    with SelfRAG.open(home=home, model={"n_threads": 1}) as rag:
        rag.index(corpus)
        assert "rollo" in cites(rag.answer(question, **dials))
        removal = rag.remove("rollo")
        assert (removal.documents, removal.passages) == (["rollo"], 1)
        # The same question again: the query cache must not hand back the answer of before.
        assert "rollo" not in cites(rag.answer(question, **dials))
    with SelfRAG.open(home=home, model={"n_threads": 1}) as rag:
        assert [d.id for d in rag.documents()] == ["apples"]
        assert "rollo" not in cites(rag.answer(question, **dials))
        # Another collection of the home, chosen per call: its own documents and answers.
        other = tmp_path / "other.jsonl"
        row = {"id": "paris", "title": "Paris", "text": "Paris is the capital of France."}
        other.write_text(json.dumps(row) + "\n", encoding="utf-8")
        rag.index(other, collection="cities")
        assert [d.id for d in rag.documents(collection="cities")] == ["paris"]
        assert [d.id for d in rag.documents()] == ["apples"]
        assert cites(rag.answer(question, collection="cities", **dials)) == {"paris"}
        assert "paris" not in cites(rag.answer(question, **dials))
        with pytest.raises(ValueError, match="collection"):
            rag.answer(question, collection="../escape", **dials)
        with pytest.raises(ValueError, match="collection"):
            rag.documents(collection="../escape")
        # A PDF's passages cite their page.
        pdf = write_pdf(
            tmp_path / "atlas.pdf",
            [["Lyon lies on the Rhone."], ["Rouen is the capital of Normandy."]],
        )
        rag.index(pdf, collection="pdfs")
        r = rag.answer("What is the capital of Normandy?", collection="pdfs", **dials)
        pages = {s.citation.passage_id: s.citation.page for s in r.segments if s.citation}
        assert pages and all(page in (1, 2) for page in pages.values()), r.segments
        assert pages.get(next(p.id for p in r.passages if "Rouen" in p.text), 2) == 2


# --- indexing on Ray --------------------------------------------------------------------------


@pytest.mark.real
def test_index_on_ray_writes_what_one_process_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from selfrag.cli import main

    folder = _folder(tmp_path)
    base = ["index", "--no-progress", "--no-calibrate"]
    assert main(["--home", str(tmp_path / "one"), *base, str(folder)]) == 0
    assert (
        main(["--home", str(tmp_path / "ray"), *base, "--ray", "--actors", "2", str(folder)]) == 0
    )
    out = capsys.readouterr().out
    assert "3 documents" in out

    def searched(home: Path) -> tuple[dict[str, str], list[list[tuple[str, float]]]]:
        dense = RetrievalSettings(hybrid=False)  # scores are cosines: equal vectors, equal scores
        with QdrantStore.open(dense, home, SentenceEmbedder()) as store:
            texts = {p.id: p.text for p in store.passages()}
            queries = sorted(texts.values())
            hits = [[(p.id, p.score) for p in found] for found in store.search_many(queries, 3)]
        return texts, hits

    one, ray = searched(tmp_path / "one"), searched(tmp_path / "ray")
    assert one[0] == ray[0] and len(one[0]) > 3
    for a, b in zip(one[1], ray[1], strict=True):
        assert [pid for pid, _ in a] == [pid for pid, _ in b]
        assert [s for _, s in a] == pytest.approx([s for _, s in b], abs=1e-4)
