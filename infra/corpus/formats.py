"""The text of PDF and HTML files, as blocks (infra.corpus.passages) ready to be split into
passages.

PDF: pypdf reads the text layer page by page; each page's paragraphs are blocks of that page
(1-based), so a passage never spans two pages and its citation can name its page. A PDF with
no text layer (a scan) is refused with that reason: OCR is not done here. pypdf's warnings about
a damaged file go to selfrag's log at DEBUG, never bare to stderr.

HTML: Beautiful Soup (Python's own `html.parser`) parses the page; the main content is the
`<main>`, else the `<article>`, else the `<body>`, without navigation, headers, footers, asides,
forms and scripts. Headings set the section path; `<pre>` and `<table>` are whole blocks,
paragraph-like tags (`<p>`, `<li>`, ...) blocks of their own, and the text between them (straight
in a `<div>`, the `<body>` or the `<main>`, inline tags included) a block of each run. The page
is walked once, without recursion. The title is `<title>` (else the first `<h1>`); the page's
own URL is its canonical link or `og:url`, when that is an absolute http(s) address.

Both are bounded by `ReadLimits`: the text a file yields (a PDF of nested forms turns a few KB
into megabytes of text) and the time its reading takes. A file over a bound is an
`UnreadableFile` naming the bound and the setting that raises it.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from io import BytesIO
from typing import Any
from urllib.parse import urlsplit

from selfrag.infra.corpus.passages import Block, text_blocks
from selfrag.schemas.settings import (
    MAX_DOCUMENT_BYTES,
    MAX_PAGE_CHARS,
    READ_TIMEOUT_S,
    RetrievalSettings,
)

log = logging.getLogger(__name__)

MAX_URL_CHARS = 2048
PDF_SUFFIXES = frozenset({".pdf"})
HTML_SUFFIXES = frozenset({".html", ".htm", ".xhtml"})
_DROPPED_TAGS = (
    "script",
    "style",
    "noscript",
    "template",
    "nav",
    "header",
    "footer",
    "aside",
    "form",
    "svg",
    "iframe",
    "button",
)
_HEADINGS = ("h1", "h2", "h3", "h4", "h5", "h6")
_TEXT_TAGS = ("p", "li", "blockquote", "dt", "dd", "figcaption", "caption", "summary")
_WHOLE_TAGS = ("pre", "table")
# Tags inside a run of text: their text joins the run around them. Any other tag (a div, a
# section, a list) ends the run before it and after it.
_INLINE_TAGS = frozenset(
    (
        "a abbr acronym b bdi bdo big br cite code data del dfn em font i img input ins kbd "
        "label mark nobr q rp rt ruby s samp small span strike strong sub sup time tt u var wbr"
    ).split()
)


class UnreadableFile(ValueError):
    """A file of a known format that cannot be read; the message says why."""


@dataclass(frozen=True)
class ReadLimits:
    """What reading one file may yield and take: the UTF-8 bytes of a document's text, the
    characters of one PDF page's text, and the seconds its reading takes."""

    max_document_bytes: int = MAX_DOCUMENT_BYTES
    max_page_chars: int = MAX_PAGE_CHARS
    timeout_s: float = READ_TIMEOUT_S

    @classmethod
    def of(cls, retrieval: RetrievalSettings) -> ReadLimits:
        """The bounds the settings set (`retrieval.max_document_bytes`, `max_page_chars`,
        `read_timeout_s`)."""
        return cls(retrieval.max_document_bytes, retrieval.max_page_chars, retrieval.read_timeout_s)


class _OverLimit(BaseException):
    """A bound of `ReadLimits` was passed. A BaseException: pypdf catches every Exception a
    form XObject raises and reads on, which would read the rest of a bomb."""


class _Budget:
    """One file's reading against its `ReadLimits`, checked as the reader goes."""

    def __init__(self, limits: ReadLimits) -> None:
        self.limits = limits
        self._deadline = time.monotonic() + limits.timeout_s
        self.document_chars = 0
        self.page_chars = 0
        self.page = 0

    def check_time(self) -> None:
        if time.monotonic() > self._deadline:
            raise _OverLimit(
                f"reading it took longer than {self.limits.timeout_s:g} s "
                "(retrieval.read_timeout_s): skipped; raise the setting if it is a real document"
            )

    def new_page(self, number: int) -> None:
        self.page, self.page_chars = number, 0

    def add(self, chars: int) -> None:
        """`chars` more characters of text on the current page."""
        self.page_chars += chars
        self.document_chars += chars
        if self.page_chars > self.limits.max_page_chars:
            raise _OverLimit(
                f"page {self.page} yields more than {self.limits.max_page_chars} characters of "
                "text (retrieval.max_page_chars): skipped; raise the setting if it is a real "
                "document"
            )
        # Characters, counted as they come, are at most the UTF-8 bytes they make.
        if self.document_chars > self.limits.max_document_bytes:
            self.over_document()

    def over_document(self) -> None:
        raise _OverLimit(
            f"its text is more than {self.limits.max_document_bytes} bytes "
            "(retrieval.max_document_bytes): skipped; raise the setting if it is a real document"
        )


class _PypdfToLog(logging.Handler):
    """pypdf's records (a damaged file's "EOF marker not found", ...) into selfrag's log at
    DEBUG: without a handler of its own they reached stderr bare, naming no file."""

    def emit(self, record: logging.LogRecord) -> None:
        log.debug("pypdf: %s", record.getMessage())


def _route_pypdf_log() -> None:
    """Send pypdf's log records to `_PypdfToLog` only (once per process)."""
    pypdf_log = logging.getLogger("pypdf")
    if not any(isinstance(h, _PypdfToLog) for h in pypdf_log.handlers):
        pypdf_log.addHandler(_PypdfToLog())
        pypdf_log.propagate = False


@dataclass(frozen=True)
class Extracted:
    """What a reader found in one file."""

    title: str | None
    blocks: list[Block]
    url: str | None = None


def read_pdf(data: bytes, limits: ReadLimits | None = None) -> Extracted:
    """The text layer of a PDF, one block per paragraph of each page, within `limits`."""
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    _route_pypdf_log()
    budget = _Budget(limits or ReadLimits())

    def before_operator(*_: object) -> None:  # every operator, a form's included
        budget.check_time()

    def on_text(text: str, *_: object) -> None:
        budget.add(len(text))

    try:
        reader = PdfReader(BytesIO(data), strict=False)
        if reader.is_encrypted and not reader.decrypt(""):
            raise UnreadableFile("encrypted PDF (a password is needed)")
        pages = []
        for number, page in enumerate(reader.pages, start=1):
            budget.check_time()
            budget.new_page(number)
            text = page.extract_text(visitor_operand_before=before_operator, visitor_text=on_text)
            pages.append(text or "")
        meta_title = reader.metadata.title if reader.metadata else None
    except _OverLimit as over:
        raise UnreadableFile(str(over)) from None
    except UnreadableFile:
        raise
    except Exception as error:  # pypdf raises many kinds on a damaged file, not only its own
        kind = "PdfReadError" if isinstance(error, PdfReadError) else type(error).__name__
        raise UnreadableFile(f"unreadable PDF ({kind}: {error})") from None
    if sum(len(p.encode("utf-8")) for p in pages) > budget.limits.max_document_bytes:
        try:
            budget.over_document()
        except _OverLimit as over:
            raise UnreadableFile(str(over)) from None
    blocks = [
        block
        for number, text in enumerate(pages, start=1)
        for block in text_blocks(_pdf_page_text(text), page=number)
    ]
    if not blocks:
        raise UnreadableFile(
            f"no text layer in {len(pages)} page(s) (a scanned PDF? run OCR on it first)"
        )
    title = str(meta_title).strip() if isinstance(meta_title, str) and meta_title.strip() else None
    return Extracted(title, blocks)


def _pdf_page_text(text: str) -> str:
    """A page's text with its layout line breaks joined: a line break inside a paragraph is a
    space; an empty line, or a line ending a sentence before a short line, stays a break."""
    lines = [line.strip() for line in text.replace("\r", "\n").split("\n")]
    out: list[str] = []
    for line in lines:
        if not line:
            out.append("")
        elif out and out[-1] and out[-1].endswith("-") and not out[-1].endswith(" -"):
            out[-1] = out[-1][:-1] + line  # a word hyphenated at the line's end
        elif out and out[-1]:
            out[-1] += " " + line
        else:
            out.append(line)
    return "\n\n".join(p for p in out if p)


def read_html(data: bytes, limits: ReadLimits | None = None) -> Extracted:
    """The main content of an HTML page as blocks, its title and its own URL, within
    `limits`' time (its text is at most its size, which the caller bounds)."""
    from bs4 import BeautifulSoup, Tag

    budget = _Budget(limits or ReadLimits())
    try:
        soup = BeautifulSoup(data, builder=_timed_builder(budget))
        title_tag = soup.find("title")
        title = _clean(title_tag.get_text()) if isinstance(title_tag, Tag) else ""
        url = _own_url(soup)
        for tag in soup.find_all(_DROPPED_TAGS):
            tag.decompose()
        root = soup.find("main") or soup.find(attrs={"role": "main"}) or soup.find("article")
        budget.check_time()
        blocks, first_h1 = _html_blocks(root or soup.find("body") or soup, budget)
    except _OverLimit as over:
        raise UnreadableFile(str(over)) from None
    except Exception as error:  # the parser is lenient; this is a last line
        raise UnreadableFile(f"unreadable HTML ({type(error).__name__}: {error})") from None
    if not blocks:
        raise UnreadableFile("no text in the page's main content")
    return Extracted(title or first_h1, blocks, url)


# How much of a page Python's HTML parser takes between two looks at the clock: large, since
# the parser scans what it holds again at each feed while a construct (a long script) is open.
_FEED_CHARS = 1 << 20
# How deep elements nest; a deeper one closes the innermost open element first, becoming its
# sibling (browsers' parsers keep such a limit too: Chromium's is 512). Beautiful Soup walks up
# every open ancestor for each text that follows a child element, which is quadratic in a page
# of unclosed <div>s.
MAX_HTML_DEPTH = 512


def _timed_builder(budget: _Budget) -> Any:
    """Beautiful Soup's `html.parser` tree builder, feeding the parser `_FEED_CHARS` at a time
    and checking `budget`'s time in between (its parse is the largest part of a page's read),
    nesting elements at most `MAX_HTML_DEPTH` deep."""
    from bs4.builder import HTMLParserTreeBuilder
    from bs4.builder._htmlparser import BeautifulSoupHTMLParser

    class Parser(BeautifulSoupHTMLParser):
        def feed(self, data: str) -> None:
            for start in range(0, len(data), _FEED_CHARS):
                budget.check_time()
                super().feed(data[start : start + _FEED_CHARS])

        def handle_starttag(
            self, tag: str, attrs: list[tuple[str, str | None]], handle_empty_element: bool = True
        ) -> None:
            soup = self.soup
            if len(soup.tagStack) > MAX_HTML_DEPTH:  # the stack holds the document's root too
                soup.handle_endtag(soup.currentTag.name)
            super().handle_starttag(tag, attrs, handle_empty_element)

    class Builder(HTMLParserTreeBuilder):
        def feed(self, markup: Any) -> None:  # type: ignore[override]
            super().feed(markup, _parser_class=Parser)

    return Builder()


def _html_blocks(root: Any, budget: _Budget) -> tuple[list[Block], str | None]:
    """The blocks of `root`, walked once in document order with a stack (a page may nest
    thousands deep), and the first `<h1>`'s text."""
    from bs4 import NavigableString, Tag

    blocks: list[Block] = []
    path: list[tuple[int, str]] = []
    first_h1: str | None = None
    run: list[str] = []  # the text since the last block

    def section() -> tuple[str, ...]:
        return tuple(t for _, t in path)

    def end_run() -> None:
        if text := _clean(" ".join(run)):
            blocks.append(Block(text, section()))
        run.clear()

    # Each entry: the children left to walk, and whether a run ends with them (a block tag's).
    stack: list[tuple[Any, bool]] = [(iter(root.contents), True)]
    while stack:
        budget.check_time()
        children, ends_run = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            if ends_run:
                end_run()
            continue
        if not isinstance(child, Tag):
            if type(child) is NavigableString:  # not a comment, CDATA or doctype
                run.append(str(child))
            continue
        name = child.name
        if name in _INLINE_TAGS:
            run.append(" ")
            stack.append((iter(child.contents), False))
            continue
        end_run()
        if name in _HEADINGS:
            if text := _clean(child.get_text(" ")):
                level = int(name[1])
                first_h1 = first_h1 or (text if level == 1 else None)
                while path and path[-1][0] >= level:
                    path.pop()
                path.append((level, text))
        elif name == "pre":
            if code := child.get_text().strip("\n"):
                blocks.append(Block(code, section(), whole=True))
        elif name == "table":
            if rows := _table_rows(child):
                blocks.append(Block(rows, section(), whole=True))
        elif name in _TEXT_TAGS:
            if text := _clean(child.get_text(" ")):
                blocks.append(Block(text, section()))
        else:
            stack.append((iter(child.contents), True))
    return blocks, first_h1


def _table_rows(table: object) -> str:
    """A table's own rows (not those of a table in one of its cells, whose text is in that
    cell's), a line each, its cells joined by ` | `. Anything else in the table but a caption
    (a cell or a table outside a row, as a page nested deeper than `MAX_HTML_DEPTH` leaves
    them) is a line of its own: its text is not lost."""
    from bs4 import Tag

    assert isinstance(table, Tag)
    rows = []
    groups = [table]
    while groups:  # the table, then its row groups (thead, tbody, tfoot) in turn
        for child in groups.pop(0).children:
            if not isinstance(child, Tag) or child.name in ("caption", "colgroup", "col"):
                continue
            if child.name in ("thead", "tbody", "tfoot"):
                groups.append(child)
            elif child.name == "tr":
                cells = child.find_all(["th", "td"], recursive=False)
                if any(texts := [_clean(c.get_text(" ")) for c in cells]):
                    rows.append(" | ".join(texts))
            elif text := _clean(child.get_text(" ")):
                rows.append(text)
    return "\n".join(rows)


def _own_url(soup: object) -> str | None:
    from bs4 import Tag

    assert isinstance(soup, Tag)
    candidates = []
    for link in soup.find_all("link", href=True):
        rel = link.get("rel") or []
        if "canonical" in (rel if isinstance(rel, list) else [rel]):
            candidates.append(link["href"])
    for meta in soup.find_all("meta", attrs={"property": "og:url"}):
        candidates.append(meta.get("content"))
    for url in candidates:
        if isinstance(url, str) and url.strip() and bad_url(url.strip()) is None:
            return url.strip()
    return None


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def bad_url(url: Any) -> str | None:
    """Why a document's `url` cannot be a citation's link (clients render it as one, so only an
    absolute http(s) address without spaces), or None if it can."""
    if not isinstance(url, str):
        return "'url' is not a string"
    if not url:
        return None
    if len(url) > MAX_URL_CHARS:
        return f"'url' is longer than {MAX_URL_CHARS} characters"
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed "[" of an IPv6 host
        parts = None
    if (
        parts is None
        or parts.scheme.lower() not in ("http", "https")
        or not parts.netloc
        or any(c.isspace() or not c.isprintable() for c in url)
    ):
        return f"'url' must be an absolute http(s) URL, got {url[:80]!r}"
    return None
