"""Splitting documents into passages by their structure (pure text work, no model).

A document is a run of `Block`s (a paragraph, a code block, a table, a PDF page's paragraph),
each with the section path it sits under and its page. Passages are packed from consecutive
blocks of one section and page, up to a budget of word pieces counted by the embedder's own
tokenizer (`count`); a block over the budget is cut at sentences, then words, then characters,
so every passage is bounded in tokens and characters whatever the text (one unspaced run of
"a." included). A code block or table (`whole`) is never cut when it fits the budget.

Markdown is read into blocks here (ATX headings, fenced code, pipe tables, paragraphs); HTML
and PDF readers (infra.corpus.formats) build blocks themselves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from selfrag.pipeline.protocols import Passage

SECTION_SEPARATOR = " › "
CHARS_PER_PIECE = 8
"""A passage holds at most this many characters per word piece of its budget: a word of more
than 100 characters is one [UNK] piece to BERT, however long, so tokens alone bound nothing."""
_LONG_WORD = 100  # BERT's `max_input_chars_per_word`: a longer word is cut here first
_SENTENCE_END = re.compile(r"(?<=[.!?…。])\s+")
_ATX = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_TABLE_ROW = re.compile(r"^ {0,3}\|")

Counter = Callable[[str], int]
"""The word pieces of a text (no [CLS]/[SEP]), as the embedder tokenizes it."""


@dataclass(frozen=True)
class Block:
    """One unit of a document's structure."""

    text: str
    section: tuple[str, ...] = ()
    page: int | None = None
    whole: bool = False
    """A code block or table: kept in one passage, with its line breaks, when it fits."""


def markdown_blocks(text: str) -> list[Block]:
    """The blocks of a Markdown text: ATX headings set the section path (they are not passage
    text), fenced code blocks and pipe tables are whole blocks, blank lines end paragraphs."""
    blocks: list[Block] = []
    path: list[tuple[int, str]] = []
    lines = text.splitlines()
    paragraph: list[str] = []

    def section() -> tuple[str, ...]:
        return tuple(title for _, title in path)

    def end_paragraph() -> None:
        if paragraph and (joined := "\n".join(paragraph).strip()):
            blocks.append(Block(joined, section()))
        paragraph.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if fence := _FENCE.match(line):
            end_paragraph()
            mark = fence[1]
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith(mark):
                j += 1
            code = "\n".join(lines[i : j + 1]).strip()
            blocks.append(Block(code, section(), whole=True))
            i = j + 1
            continue
        if _TABLE_ROW.match(line):
            end_paragraph()
            j = i
            while j < len(lines) and _TABLE_ROW.match(lines[j]):
                j += 1
            blocks.append(Block("\n".join(lines[i:j]).strip(), section(), whole=True))
            i = j
            continue
        if heading := _ATX.match(line):
            end_paragraph()
            level = len(heading[1])
            while path and path[-1][0] >= level:
                path.pop()
            path.append((level, heading[2].strip()))
        elif not line.strip():
            end_paragraph()
        else:
            paragraph.append(line)
        i += 1
    end_paragraph()
    return blocks


def text_blocks(text: str, section: tuple[str, ...] = (), page: int | None = None) -> list[Block]:
    """Paragraphs (separated by blank lines) of a plain text."""
    return [
        Block(part.strip(), section, page) for part in re.split(r"\n\s*\n", text) if part.strip()
    ]


def section_title(title: str | None, section: Sequence[str]) -> str | None:
    """A passage's title: the document's, then its section path (a first heading that repeats
    the document's title is not said twice)."""
    parts = [title] if title else []
    parts += [s for i, s in enumerate(section) if not (i == 0 and title and s == title)]
    return SECTION_SEPARATOR.join(parts) if parts else None


def pack_blocks(
    blocks: Sequence[Block], budget: int, count: Counter
) -> Iterator[tuple[str, Block]]:
    """Passage texts from `blocks`, each with the first block it holds: consecutive blocks of
    one section and page share a passage while their pieces fit `budget`; a block that does
    not fit alone is cut at sentences (`split_on_sentences`)."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    max_chars = budget * CHARS_PER_PIECE
    held: list[str] = []
    first: Block | None = None
    used = chars = 0
    for block in blocks:
        if first is not None and (block.section, block.page) != (first.section, first.page):
            yield "\n\n".join(held), first
            held, first, used, chars = [], None, 0, 0
        n = count(block.text)
        if n > budget or len(block.text) > max_chars:
            if first is not None:
                yield "\n\n".join(held), first
                held, first, used, chars = [], None, 0, 0
            for piece in split_on_sentences(block.text, budget, count):
                yield piece, block
            continue
        if first is not None and (used + n > budget or chars + len(block.text) + 2 > max_chars):
            yield "\n\n".join(held), first
            held, first, used, chars = [], None, 0, 0
        held.append(block.text)
        first = first or block
        used += n
        chars += len(block.text) + 2
    if first is not None:
        yield "\n\n".join(held), first


def cut_text(text: str, budget: int, count: Counter) -> list[str]:
    """`text` in pieces of at most `budget` word pieces and `budget * CHARS_PER_PIECE`
    characters, packing whole words (a word longer than 100 characters, or than the budget,
    is cut into runs of characters first). Whitespace inside a piece becomes single spaces."""
    max_chars = budget * CHARS_PER_PIECE
    pieces: list[str] = []
    words: list[str] = []
    used = chars = 0
    for word in _words(text, min(budget, _LONG_WORD)):
        n = count(word)
        if words and (used + n > budget or chars + 1 + len(word) > max_chars):
            pieces.append(" ".join(words))
            words, used, chars = [], 0, 0
        words.append(word)
        used += n
        chars += len(word) + (1 if len(words) > 1 else 0)
    if words:
        pieces.append(" ".join(words))
    return pieces


def _words(text: str, longest: int) -> Iterator[str]:
    """The whitespace-separated words of `text`, a word longer than `longest` characters cut
    into runs of `longest` (each then at most `longest` pieces)."""
    for word in text.split():
        if len(word) <= longest:
            yield word
        else:
            for start in range(0, len(word), longest):
                yield word[start : start + longest]


def split_on_sentences(text: str, budget: int, count: Counter) -> list[str]:
    """`text` cut into pieces within `budget` at sentence ends where it can, packing whole
    sentences; a sentence over the budget alone is cut at words (`cut_text`)."""
    max_chars = budget * CHARS_PER_PIECE
    out: list[str] = []
    held: list[str] = []
    used = chars = 0
    for sentence in _SENTENCE_END.split(text.strip()):
        sentence = " ".join(sentence.split())
        if not sentence:
            continue
        n = count(sentence)
        if n > budget or len(sentence) > max_chars:
            if held:
                out.append(" ".join(held))
                held, used, chars = [], 0, 0
            out += cut_text(sentence, budget, count)
            continue
        if held and (used + n > budget or chars + 1 + len(sentence) > max_chars):
            out.append(" ".join(held))
            held, used, chars = [], 0, 0
        held.append(sentence)
        used += n
        chars += len(sentence) + 1
    if held:
        out.append(" ".join(held))
    return out


def structured_passages(
    doc_id: str,
    title: str | None,
    blocks: Sequence[Block],
    budget: int,
    count: Counter,
    metadata: dict[str, str],
) -> list[Passage]:
    """The passages of one document's blocks: ids `{doc_id}` for a one-passage document and
    `{doc_id}#{n}` otherwise (stable, so re-indexing overwrites); the title carries the section
    path, the metadata `page` the PDF page (1-based) when there is one."""
    texts = list(pack_blocks(blocks, budget, count))
    passages = []
    for n, (text, block) in enumerate(texts):
        meta = dict(metadata)
        if block.page is not None:
            meta["page"] = str(block.page)
        if block.section:
            meta["section"] = SECTION_SEPARATOR.join(block.section)
        passages.append(
            Passage(
                id=doc_id if len(texts) == 1 else f"{doc_id}#{n}",
                text=text,
                title=section_title(title, block.section),
                metadata=meta,
            )
        )
    return passages
