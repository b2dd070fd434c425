"""infra/corpus/formats.py under attack: PDFs whose few bytes expand to megabytes of text (nested
form XObjects), pages of deeply nested HTML, and library noise. A file over a bound of
`ReadLimits` is an `UnreadableFile` saying which bound and which setting raises it; the rest of a
folder is read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from selfrag.infra.corpus.formats import (
    MAX_HTML_DEPTH,
    ReadLimits,
    UnreadableFile,
    read_html,
    read_pdf,
)
from selfrag.infra.corpus.reading import CorpusError, Document, read_documents
from tests.corpus_files import pdf_form_bomb, write_pdf
from tests.paths import ROOT

# Far above what these files take when read linearly (well under a second each), far below
# what the unbounded readers took (a minute and more).
GENEROUS_S = 30.0


def test_a_pdf_of_nested_forms_stops_at_the_page_bound_naming_it() -> None:
    """1.9 KB of nested form XObjects gave 0.8 MB of text in 8 s (pypdf bounds the form
    invocations of a page, not their text); larger leaves gave 4 MB and more."""
    bomb = pdf_form_bomb(levels=5, fanout=8, leaf_chars=200)
    assert len(bomb) < 2500
    limits = ReadLimits(max_page_chars=20_000, timeout_s=GENEROUS_S)
    with pytest.raises(UnreadableFile, match=r"page 1 .*20000 characters.*max_page_chars"):
        read_pdf(bomb, limits)


def test_a_pdf_over_the_document_bound_stops_there_though_each_page_is_within_its_own() -> None:
    bomb = pdf_form_bomb(levels=4, fanout=8, leaf_chars=150, pages=6)  # 77k characters a page
    limits = ReadLimits(max_document_bytes=300_000, max_page_chars=1_000_000, timeout_s=GENEROUS_S)
    with pytest.raises(UnreadableFile, match=r"more than 300000 .*max_document_bytes"):
        read_pdf(bomb, limits)
    # Within both bounds, the same file is read.
    assert read_pdf(bomb, ReadLimits(timeout_s=GENEROUS_S)).blocks


def test_a_pdf_that_takes_longer_than_the_time_limit_is_refused() -> None:
    """Operators that draw no text cost time without growing any text bound."""
    slow = pdf_form_bomb(levels=4, fanout=16, leaf_chars=0, leaf_ops=400)
    with pytest.raises(UnreadableFile, match=r"longer than 0.2 s .*read_timeout_s"):
        read_pdf(slow, ReadLimits(timeout_s=0.2))


def test_a_folder_with_a_pdf_bomb_reads_its_other_files(tmp_path: Path) -> None:
    (tmp_path / "bomb.pdf").write_bytes(pdf_form_bomb(levels=6, fanout=8, leaf_chars=1000))
    (tmp_path / "notes.md").write_text("# Notes\n\nBasalt is a volcanic rock.\n")
    write_pdf(tmp_path / "fine.pdf", [["Rollo founded Normandy."]])
    limits = ReadLimits(max_page_chars=50_000, timeout_s=GENEROUS_S)
    items = list(read_documents(tmp_path, limits=limits))
    docs = sorted(Path(i.source or "").name for i in items if isinstance(i, Document))
    errors = {Path(i.path).name: i.reason for i in items if isinstance(i, CorpusError)}
    assert docs == ["fine.pdf", "notes.md"]
    assert list(errors) == ["bomb.pdf"] and "max_page_chars" in errors["bomb.pdf"]


def test_indexing_reads_within_the_retrieval_settings_bounds(tmp_path: Path) -> None:
    from selfrag.jobs.indexing import corpus_passages
    from selfrag.schemas.settings import RetrievalSettings

    write_pdf(tmp_path / "long.pdf", [["A page of ordinary text, " * 20]])
    (tmp_path / "notes.md").write_text("# Notes\n\nBasalt is a volcanic rock.\n")
    read = {p.title for p in corpus_passages(tmp_path, RetrievalSettings(max_page_chars=100))}
    assert read == {"Notes"}


def test_the_limits_come_from_the_retrieval_settings() -> None:
    from selfrag.schemas.settings import RetrievalSettings

    settings = RetrievalSettings(max_document_bytes=1234, max_page_chars=567, read_timeout_s=8.5)
    assert ReadLimits.of(settings) == ReadLimits(1234, 567, 8.5)
    defaults = ReadLimits.of(RetrievalSettings())
    assert defaults == ReadLimits()
    assert defaults.max_page_chars >= 50_000 and defaults.timeout_s >= 30


def test_pypdfs_warnings_go_to_selfrags_log_not_stderr(tmp_path: Path) -> None:
    """A PDF without its EOF marker printed pypdf's bare "EOF marker not found" on stderr."""
    pdf = write_pdf(tmp_path / "cut.pdf", [["Some text."]])
    pdf.write_bytes(pdf.read_bytes().replace(b"%%EOF", b"%%EOX"))
    code = (
        "import logging, sys\n"
        "from selfrag.infra.corpus.formats import UnreadableFile, read_pdf\n"
        "def read():\n"
        "    try:\n"
        "        read_pdf(open(sys.argv[1], 'rb').read())\n"
        "    except UnreadableFile as exc:\n"
        "        print(exc)\n"
        "read()\n"
        "logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)\n"
        "read()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(pdf)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    # In the log (here at DEBUG on stdout), under selfrag's name.
    assert "selfrag" in done.stdout and "EOF marker not found" in done.stdout


# --- HTML ----------------------------------------------------------------------------------


def _nested_divs(depth: int) -> bytes:
    return f"<html><body>{'<div>' * depth}deep text{'</div>' * depth}</body></html>".encode()


def test_deeply_nested_html_is_read_in_linear_time() -> None:
    """10,000 nested divs (130 KB) took 167 s: each tag looked for its ancestors."""
    found = read_html(_nested_divs(10_000), ReadLimits(timeout_s=GENEROUS_S))
    assert [b.text for b in found.blocks] == ["deep text"]


def test_a_page_of_unclosed_divs_is_read_in_linear_time_and_whole() -> None:
    """Each text after a child element made Beautiful Soup walk up every open ancestor: 2.6 MB
    of unclosed <div>s took 71 s, this page (0.5 MB) over a minute. Elements nest at most
    `MAX_HTML_DEPTH` deep, as in browsers; no text is lost."""
    count = 20_000
    assert count > 10 * MAX_HTML_DEPTH
    page = "<body>" + "".join(f"<div><p>Paragraph {i}.</p>\n" for i in range(count)) + "</body>"
    found = read_html(page.encode(), ReadLimits(timeout_s=GENEROUS_S))
    assert [b.text for b in found.blocks] == [f"Paragraph {i}." for i in range(count)]


def test_no_text_is_lost_below_the_depth_limit() -> None:
    """Below `MAX_HTML_DEPTH` an element closes the innermost open one: a paragraph may be
    split at an inline tag, a table's cells land outside its rows; all are read."""
    count = 2 * MAX_HTML_DEPTH
    chunks = [
        f"<div><h2>Part</h2><p>Some <b>p{i}</b> bold.</p><table><tr><td>a{i}</td><td>b{i}"
        f"<table><tr><td>n{i}</td></tr></table></td></tr></table>\n"
        for i in range(count)
    ]
    found = read_html(("<body>" + "".join(chunks) + "</body>").encode())
    words = re.findall(r"\b[pabn]\d+\b", " ".join(b.text for b in found.blocks))
    assert words == [f"{c}{i}" for i in range(count) for c in "pabn"]


def test_a_large_page_is_read_within_the_time_limit() -> None:
    chunk = (
        "<div class='c'><h2>Section</h2><p>Some <b>bold</b> text and a <a href='#'>link</a>."
        "</p><ul><li>one</li><li>two <i>it</i></li></ul><table><tr><td>a</td><td>b</td></tr>"
        "<tr><td><table><tr><td>inner</td></tr></table></td><td>c</td></tr></table></div>\n"
    )
    page = f"<html><body><main>{chunk * (1_000_000 // len(chunk))}</main></body></html>"
    found = read_html(page.encode(), ReadLimits(timeout_s=GENEROUS_S))
    texts = [b.text for b in found.blocks]
    assert texts[:4] == ["Some bold text and a link .", "one", "two it", "a | b\ninner | c"]
    assert all(b.section == ("Section",) for b in found.blocks)


def test_nested_tables_give_each_cell_once() -> None:
    depth = 3_000
    page = "<body>" + "<table><tr><td>" * depth + "x" + "</td></tr></table>" * depth + "</body>"
    found = read_html(page.encode(), ReadLimits(timeout_s=GENEROUS_S))
    assert [b.text for b in found.blocks] == ["x"]


def test_html_reading_stops_at_the_time_limit() -> None:
    page = "<body>" + "<div><p>paragraph</p></div>" * 20_000 + "</body>"
    with pytest.raises(UnreadableFile, match=r"longer than 0.05 s"):
        read_html(page.encode(), ReadLimits(timeout_s=0.05))


@pytest.mark.parametrize(
    ("page", "blocks"),
    [
        ("<html><body>Text straight in the body.</body></html>", ["Text straight in the body."]),
        (
            "<body><main>Lead <b>bold</b> words.<p>A paragraph.</p>Tail text<br>after.</main>"
            "</body>",
            ["Lead bold words.", "A paragraph.", "Tail text after."],
        ),
        (
            "<body><div>Own text <span>in a <a href='#'>link</a></span> here"
            "<section><h2>Part</h2>Loose text.</section></div></body>",
            ["Own text in a link here", "Loose text."],
        ),
    ],
)
def test_text_directly_in_the_body_or_main_is_read(page: str, blocks: list[str]) -> None:
    """Such a page was skipped as "no text in the page's main content"."""
    found = read_html(page.encode())
    assert [b.text for b in found.blocks] == blocks


def test_a_heading_inside_a_link_still_names_its_section() -> None:
    page = "<body><a href='/x'><h2>Linked</h2></a><p>Under it.</p></body>"
    found = read_html(page.encode())
    assert [(b.section, b.text) for b in found.blocks] == [(("Linked",), "Under it.")]
