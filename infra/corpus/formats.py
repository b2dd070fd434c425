"""The text of PDF and HTML files, as blocks (infra.corpus.passages) ready to be split into
passages.

PDF: pypdf reads the text layer page by page; each page's paragraphs are blocks of that page
(1-based), so a passage never spans two pages and its citation can name its page. A PDF with
no text layer (a scan) is refused with that reason: OCR is not done here.

HTML: Beautiful Soup (Python's own `html.parser`) parses the page; the main content is the
`<main>`, else the `<article>`, else the `<body>`, without navigation, headers, footers, asides,
forms and scripts. Headings set the section path; `<pre>` and `<table>` are whole blocks. The
title is `<title>` (else the first `<h1>`); the page's own URL is its canonical link or
`og:url`, when that is an absolute http(s) address.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from io import BytesIO
from typing import Any
from urllib.parse import urlsplit

from selfrag.infra.corpus.passages import Block, text_blocks

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


class UnreadableFile(ValueError):
    """A file of a known format that cannot be read; the message says why."""


@dataclass(frozen=True)
class Extracted:
    """What a reader found in one file."""

    title: str | None
    blocks: list[Block]
    url: str | None = None


def read_pdf(data: bytes) -> Extracted:
    """The text layer of a PDF, one block per paragraph of each page."""
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(BytesIO(data), strict=False)
        if reader.is_encrypted and not reader.decrypt(""):
            raise UnreadableFile("encrypted PDF (a password is needed)")
        pages = [page.extract_text() or "" for page in reader.pages]
        meta_title = reader.metadata.title if reader.metadata else None
    except UnreadableFile:
        raise
    except Exception as error:  # pypdf raises many kinds on a damaged file, not only its own
        kind = "PdfReadError" if isinstance(error, PdfReadError) else type(error).__name__
        raise UnreadableFile(f"unreadable PDF ({kind}: {error})") from None
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


def read_html(data: bytes) -> Extracted:
    """The main content of an HTML page as blocks, its title and its own URL."""
    from bs4 import BeautifulSoup, Tag

    try:
        soup = BeautifulSoup(data, "html.parser")
    except Exception as error:  # the parser is lenient; this is a last line
        raise UnreadableFile(f"unreadable HTML ({type(error).__name__}: {error})") from None
    title_tag = soup.find("title")
    title = _clean(title_tag.get_text()) if isinstance(title_tag, Tag) else ""
    url = _own_url(soup)
    for tag in soup.find_all(_DROPPED_TAGS):
        tag.decompose()
    root = soup.find("main") or soup.find(attrs={"role": "main"}) or soup.find("article")
    root = root or soup.find("body") or soup
    blocks: list[Block] = []
    path: list[tuple[int, str]] = []
    first_h1: str | None = None
    for tag in root.find_all([*_HEADINGS, *_TEXT_TAGS, *_WHOLE_TAGS, "div"]):
        if not isinstance(tag, Tag) or tag.find_parent([*_WHOLE_TAGS, *_TEXT_TAGS]) is not None:
            continue  # its text belongs to the block that holds it
        section = tuple(t for _, t in path)
        if tag.name in _HEADINGS:
            text = _clean(tag.get_text(" "))
            if not text:
                continue
            level = int(tag.name[1])
            first_h1 = first_h1 or (text if level == 1 else None)
            while path and path[-1][0] >= level:
                path.pop()
            path.append((level, text))
        elif tag.name == "pre":
            if code := tag.get_text().strip("\n"):
                blocks.append(Block(code, section, whole=True))
        elif tag.name == "table":
            if rows := _table_rows(tag):
                blocks.append(Block(rows, section, whole=True))
        elif tag.name == "div":
            # Text written straight into a div (no <p>) is content too.
            own = _clean(" ".join(s for s in tag.find_all(string=True, recursive=False)))
            if own:
                blocks.append(Block(own, section))
        elif text := _clean(tag.get_text(" ")):
            blocks.append(Block(text, section))
    if not blocks:
        raise UnreadableFile("no text in the page's main content")
    return Extracted(title or first_h1, blocks, url)


def _table_rows(table: object) -> str:
    from bs4 import Tag

    assert isinstance(table, Tag)
    rows = []
    for row in table.find_all("tr"):
        cells = [_clean(c.get_text(" ")) for c in row.find_all(["th", "td"])]
        if any(cells):
            rows.append(" | ".join(cells))
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
