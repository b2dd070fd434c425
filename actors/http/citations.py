"""An answer's citations in the shapes chat clients render (`/v1/chat/completions`).

- OpenAI's `url_citation` annotations: one per cited segment, over the segment's span of the
  answer text (`start_index` inclusive, `end_index` exclusive, in characters), with the cited
  document's URL and title. In a stream each rides on the chunk that carries its segment's
  text, so a client sees it as soon as the segment is sent, with indexes into the text
  streamed so far (which the later chunks only extend).
- Perplexity's top-level `citations`: the distinct URLs the answer cites, in the order first
  cited. LobeChat reads it from a stream's closing chunk (and Perplexity, xAI and litellm
  clients from a response), while it ignores annotations on chunks that carry text.

A passage's URL is its document's own (the corpus record's `url`, without credentials and with
a non-ASCII host in its `xn--` form), else `selfrag://passage/<id>` with the id
percent-encoded, which names the passage stably. Titles go out as plain text.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote, urlsplit, urlunsplit

from selfrag.schemas.answer import AnswerResponse, Citation, SegmentFlag, SegmentOut
from selfrag.schemas.openai import Annotation, URLCitation
from selfrag.schemas.text import plain_title

PASSAGE_URL_PREFIX = "selfrag://passage/"


def passage_url(citation: Citation) -> str:
    """The URL a client links the citation to: the document's own as `link_url` shows it,
    else the passage's."""
    own = link_url(citation.url) if citation.url else None
    return own or PASSAGE_URL_PREFIX + quote(citation.passage_id, safe="")


def link_url(url: str) -> str | None:
    """`url` as a client may link it: credentials (`user:pass@`, which can also hide the real
    host behind a name: `https://bank.example@evil.example/`) dropped, and a host of non-ASCII
    letters spelt in its ASCII (IDNA) form, so a look-alike of another script shows as the
    `xn--` name it is; None when it is no absolute http(s) URL or its host has no such form."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:  # a bad port, an unclosed IPv6 bracket
        return None
    if parts.scheme.lower() not in ("http", "https") or not host:
        return None
    if any(c.isspace() or not c.isprintable() for c in url):
        return None
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            return None
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    return urlunsplit((parts.scheme.lower(), netloc, parts.path, parts.query, parts.fragment))


class AnswerText:
    """The answer's text as its segments are appended, the way `AnswerResponse.answer` joins
    them (leading whitespace dropped until the text begins), and each cited segment's
    annotation over its span (its own surrounding whitespace left out)."""

    def __init__(self) -> None:
        self.length = 0

    def append(self, segment: SegmentOut) -> tuple[str, Annotation | None]:
        """The segment's text as it joins the answer, and its annotation if it cites one."""
        text = segment.text.lstrip() if self.length == 0 else segment.text
        start = self.length + len(text) - len(text.lstrip())
        end = self.length + len(text.rstrip())
        self.length += len(text)
        if segment.citation is None or end <= start:
            return text, None
        return text, annotation(segment.citation, start, end, segment.flags)


def annotation(
    citation: Citation, start: int, end: int, flags: Sequence[SegmentFlag] = ()
) -> Annotation:
    return Annotation(
        url_citation=URLCitation(
            start_index=start,
            end_index=end,
            url=passage_url(citation),
            title=plain_title(citation.title or "") or citation.passage_id,
        ),
        flags=list(flags) or None,
    )


def annotations(response: AnswerResponse) -> list[Annotation]:
    """The cited segments' annotations over `response.answer` (none for an abstention: its
    text is the abstention message, not the segments)."""
    if response.abstained:
        return []
    text, out = AnswerText(), []
    for segment in response.segments:
        _, a = text.append(segment)
        if a is not None:
            span = response.answer[a.url_citation.start_index : a.url_citation.end_index]
            # Only a span that is this segment's text: an answer joined some other way
            # gets no annotation rather than a wrong one.
            if span == segment.text.strip():
                out.append(a)
    return out


def cited_urls(response: AnswerResponse) -> list[str]:
    """The distinct URLs the answer cites, in the order first cited (none for an
    abstention)."""
    if response.abstained:
        return []
    urls = (passage_url(s.citation) for s in response.segments if s.citation is not None)
    return list(dict.fromkeys(urls))
