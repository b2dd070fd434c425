"""Reading corpora into documents (pure I/O, no model); infra.corpus.splitting makes passages
of them.

Supported inputs:
- JSONL, one object a line: `{"id"?, "title"?, "url"?, "text" | "contents"}` (`url`: the
  document's own http(s) address, which citations then link to). A FlashRAG-style `contents`
  whose first line is a double-quoted title gives that title and the rest as text. A record
  without an id gets `{source_id(file)}:{line}`. Lines are read with a bounded read, so one
  runaway line costs at most `max_bytes` of memory, however long it is.
- SQuAD-format JSON: every paragraph is a document, id `squad:{article title}:{paragraph index}`.
  The file is parsed whole, so a file over `MAX_JSON_FILE_BYTES` is refused (convert it to JSONL,
  which is read line by line).
- A folder of `.txt`, `.md`, `.pdf` and `.html` files (or one such file): id =
  `source_id(file)`; PDF and HTML through infra.corpus.formats. Every file of a folder that is
  not read is reported with its reason (another format, a special file, a symbolic link out of
  the folder), never passed over in silence.

Bad records never stop a read: each becomes a `CorpusError` in the stream and reading goes on.
"""

from __future__ import annotations

import hashlib
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfrag.infra.corpus.bounded_reads import JSONInputError, load_json, read_lines
from selfrag.infra.corpus.formats import (
    HTML_SUFFIXES,
    PDF_SUFFIXES,
    Extracted,
    ReadLimits,
    UnreadableFile,
    bad_url,
    read_html,
    read_pdf,
)
from selfrag.infra.corpus.passages import (
    Block,
    markdown_blocks,
    text_blocks,
)
from selfrag.infra.corpus.safe_files import (
    file_source,
    folder_files,
    is_pseudo,
    read_bounded,
    too_big,
)

# Default cap on one document's UTF-8 size: far above any real article, small enough that one
# runaway record (a dumped binary, a whole book in a line) cannot stall indexing.
MAX_DOCUMENT_BYTES = 10_000_000
# A SQuAD file is one JSON value, parsed whole (several times its size in Python objects). The
# SQuAD v2 train set is 42 MB; past this bound the file belongs in JSONL, read line by line.
MAX_JSON_FILE_BYTES = 128 * 2**20
TEXT_SUFFIXES = frozenset({".txt", ".md", ".markdown"})
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
FILE_SUFFIXES = TEXT_SUFFIXES | PDF_SUFFIXES | HTML_SUFFIXES
"""What a folder's files are read as (each a document); any other file is reported."""


# A FlashRAG `contents` field starts with `"Title"` alone on its first line.
_QUOTED_TITLE = re.compile(r'\A"(?P<title>[^"\n]*)"[ \t]*\r?\n(?P<text>.*)\Z', re.DOTALL)
_MD_HEADING = re.compile(r"^\s{0,3}#{1,6}[ \t]+(?P<title>.+?)[ \t#]*$", re.MULTILINE)


@dataclass(frozen=True)
class Document:
    """One source document; `id` is stable across re-reads of the same corpus."""

    id: str
    title: str | None
    text: str
    url: str | None = None
    """The document's own http(s) address, when the corpus gives one."""
    source: str | None = None
    """The file it was read from (absolute), which `selfrag docs` lists and re-indexing checks."""
    blocks: tuple[Block, ...] = ()
    """Its structure (infra.corpus.passages); empty: `text`'s paragraphs, or its Markdown when
    `markdown`."""
    markdown: bool = False

    def structure(self) -> list[Block]:
        """The blocks passages are packed from."""
        if self.blocks:
            return list(self.blocks)
        return markdown_blocks(self.text) if self.markdown else text_blocks(self.text)


@dataclass(frozen=True)
class CorpusError:
    """A record that could not be read; `line` is 1-based, None when no line applies."""

    path: str
    line: int | None
    reason: str

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        return f"{where}: {self.reason}"


class CorpusFormatError(ValueError):
    """The path exists but is not a corpus format this module reads."""


def source_id(file: Path) -> str:
    """The id of a document named by its file (a text file, or with `:line` a JSONL record
    without an id): the file name, `@`, and 12 hex digits of the SHA-256 of the resolved
    absolute path. Two files with the same name in different folders get different ids; the
    same path gets the same id on every run, so re-indexing overwrites."""
    resolved = str(file.resolve()).encode("utf-8", "surrogateescape")
    return f"{file.name}@{hashlib.sha256(resolved).hexdigest()[:12]}"


def read_documents(
    path: str | Path,
    max_bytes: int = MAX_DOCUMENT_BYTES,
    max_json_bytes: int = MAX_JSON_FILE_BYTES,
    *,
    follow_links: bool = False,
    limits: ReadLimits | None = None,
) -> Iterator[Document | CorpusError]:
    """Yield the documents of the corpus at `path`, with a `CorpusError` for every bad record.

    A document over `max_bytes` (its JSONL line, file, or SQuAD paragraph) is such an error,
    and so is a SQuAD JSON file over `max_json_bytes` (parsing it needs the whole file). In a
    folder, every file passed over is such an error too, with its reason (`_folder_files`):
    symbolic links leaving the folder are followed only with `follow_links`. A PDF or HTML
    file is read within `limits` (default: `ReadLimits` with `max_bytes`).

    Raises FileNotFoundError when `path` does not exist and CorpusFormatError for an unknown
    format. Both are raised when the iterator is created, before the first item is read.
    """
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"corpus not found: {source}")
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    limits = limits or ReadLimits(max_document_bytes=max_bytes)
    if source.is_dir():
        return _read_folder(source, max_bytes, follow_links, limits)
    real = source.resolve()
    if is_pseudo(real) or not stat.S_ISREG(real.stat().st_mode):
        raise CorpusFormatError(f"{source} is not a regular file ({real}): never read")
    suffix = source.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _read_jsonl(source, max_bytes)
    if suffix == ".json":
        return _read_squad(source, max_bytes, max_json_bytes)
    if suffix in FILE_SUFFIXES:
        return _read_files([source], max_bytes, limits)
    raise CorpusFormatError(
        f"unknown corpus format for {source}: expected .jsonl, SQuAD .json, "
        f"{'/'.join(sorted(FILE_SUFFIXES))}, or a folder of them"
    )


def _read_jsonl(path: Path, max_bytes: int) -> Iterator[Document | CorpusError]:
    seen: dict[str, int] = {}
    file_id = source_id(path)
    # Bytes, not text mode: a bad byte then costs one line instead of aborting the whole file.
    with path.open("rb") as file:
        for raw_line in read_lines(file, max_bytes):
            number, raw = raw_line.number, raw_line.data
            if raw is None:
                yield CorpusError(str(path), number, too_big(raw_line.size, max_bytes))
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield CorpusError(
                    str(path), number, f"not UTF-8 ({error.reason} at byte {error.start})"
                )
                continue
            if not line.strip():
                continue
            try:
                record = load_json(line)
            except JSONInputError as error:
                yield CorpusError(str(path), number, f"invalid JSON: {error}")
                continue
            item = _jsonl_document(record, path, number, file_id)
            if isinstance(item, Document):
                if item.id in seen:
                    item = CorpusError(
                        str(path),
                        number,
                        f"duplicate id {item.id!r} (first at line {seen[item.id]})",
                    )
                else:
                    seen[item.id] = number
            yield item


def _jsonl_document(record: Any, path: Path, number: int, file_id: str) -> Document | CorpusError:
    if not isinstance(record, dict):
        return CorpusError(
            str(path), number, f"expected a JSON object, got {type(record).__name__}"
        )
    title = record.get("title")
    if title is not None and not isinstance(title, str):
        return CorpusError(str(path), number, "'title' is not a string")
    if "text" in record:
        text = record["text"]
    elif "contents" in record:
        text = record["contents"]
        if isinstance(text, str) and (match := _QUOTED_TITLE.match(text)):
            title = title or match["title"].strip() or None
            text = match["text"]
    else:
        return CorpusError(str(path), number, "no 'text' or 'contents' field")
    if not isinstance(text, str) or not text.strip():
        return CorpusError(str(path), number, "empty or non-string text")
    raw_id = record.get("id")
    if raw_id is None or (isinstance(raw_id, str) and not raw_id.strip()):
        doc_id = f"{file_id}:{number}"
    elif isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool):
        doc_id = str(raw_id)
    else:
        return CorpusError(str(path), number, "'id' must be a string or an integer")
    url = record.get("url")
    if url is not None and (reason := bad_url(url)):
        return CorpusError(str(path), number, reason)
    return Document(
        id=doc_id,
        title=title.strip() if title else None,
        text=text.strip(),
        url=url or None,
        source=file_source(path),
    )


def _read_squad(
    path: Path, max_bytes: int, max_json_bytes: int
) -> Iterator[Document | CorpusError]:
    size = path.stat().st_size
    if size > max_json_bytes:  # checked before reading: the file is parsed whole
        yield CorpusError(
            str(path),
            None,
            f"SQuAD JSON file too large to parse whole ({size} bytes, limit {max_json_bytes}): "
            "split it, or convert its paragraphs to JSONL ({id, title, text} a line), which is "
            "read line by line",
        )
        return
    raw = path.read_bytes()
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        yield CorpusError(str(path), raw[: error.start].count(b"\n") + 1, "not UTF-8")
        return
    try:
        data = load_json(content)
    except JSONInputError as error:
        # One JSON value for the whole file: nothing past the error can be recovered.
        yield CorpusError(str(path), error.line, f"invalid JSON: {error}")
        return
    if not (isinstance(data, dict) and isinstance(data.get("data"), list)):
        raise CorpusFormatError(f"{path} is JSON but not SQuAD format (no 'data' list of articles)")
    for a, article in enumerate(data["data"]):
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            yield CorpusError(str(path), None, f"article {a} has no 'paragraphs' list")
            continue
        raw_title = str(article.get("title") or f"article{a}")
        title = raw_title.replace("_", " ")
        for p, paragraph in enumerate(article["paragraphs"]):
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            if not isinstance(context, str) or not context.strip():
                yield CorpusError(
                    str(path), None, f"article {raw_title!r} paragraph {p}: no context"
                )
                continue
            size = len(context.encode("utf-8"))
            if size > max_bytes:
                yield CorpusError(
                    str(path),
                    None,
                    f"article {raw_title!r} paragraph {p}: {too_big(size, max_bytes)}",
                )
                continue
            yield Document(
                id=f"squad:{raw_title}:{p}",
                title=title,
                text=context.strip(),
                source=file_source(path),
            )


def _read_folder(
    folder: Path, max_bytes: int, follow_links: bool, limits: ReadLimits
) -> Iterator[Document | CorpusError]:
    items = [
        item if isinstance(item, Path) else CorpusError(item.path, None, item.reason)
        for item in folder_files(folder, follow_links, FILE_SUFFIXES)
    ]
    if not items:
        raise CorpusFormatError(
            f"folder {folder} holds no {'/'.join(sorted(FILE_SUFFIXES))} files to index"
        )
    return _read_items(items, max_bytes, limits)


def _read_items(
    items: list[Path | CorpusError], max_bytes: int, limits: ReadLimits
) -> Iterator[Document | CorpusError]:
    for item in items:
        if isinstance(item, CorpusError):
            yield item
        else:
            yield from _read_files([item], max_bytes, limits)


def _read_files(
    files: list[Path], max_bytes: int, limits: ReadLimits
) -> Iterator[Document | CorpusError]:
    for file in files:
        data = read_bounded(file, max_bytes)
        if isinstance(data, str):
            yield CorpusError(str(file), None, data)
            continue
        suffix = file.suffix.lower()
        if suffix in PDF_SUFFIXES | HTML_SUFFIXES:
            try:
                reader = read_pdf if suffix in PDF_SUFFIXES else read_html
                found = reader(data, limits)
            except UnreadableFile as error:
                yield CorpusError(str(file), None, str(error))
                continue
            yield _extracted_document(file, found)
            continue
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            line = data[: error.start].count(b"\n") + 1
            yield CorpusError(str(file), line, f"not UTF-8 ({error.reason} at byte {error.start})")
            continue
        if not text.strip():
            yield CorpusError(str(file), None, "empty file")
            continue
        title = file.stem
        markdown = suffix != ".txt"
        if markdown and (heading := _MD_HEADING.search(text)):
            title = heading["title"]
        yield Document(
            id=source_id(file),
            title=title,
            text=text.strip(),
            source=file_source(file),
            markdown=markdown,
        )


def _extracted_document(file: Path, found: Extracted) -> Document:
    return Document(
        id=source_id(file),
        title=found.title or file.stem,
        text="\n\n".join(b.text for b in found.blocks),
        url=found.url,
        source=file_source(file),
        blocks=tuple(found.blocks),
    )
