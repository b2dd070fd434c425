"""An answer's citations in the shapes chat clients render (`/v1/chat/completions`).

- OpenAI's `url_citation` annotations: one per cited segment, over the segment's span of the
  answer text (`start_index` inclusive, `end_index` exclusive, in characters), with the cited
  document's URL and title. In a stream each rides on the chunk that carries its segment's
  text, so a client sees it as soon as the segment is sent, with indexes into the text
  streamed so far (which the later chunks only extend).
- Perplexity's top-level `citations`: the distinct URLs the answer cites, in the order first
  cited. LobeChat reads it from a stream's closing chunk (and Perplexity, xAI and litellm
  clients from a response), while it ignores annotations on chunks that carry text.

A passage's URL is its document's own (the corpus record's `url`), else
`selfrag://passage/<id>` with the id percent-encoded, which names the passage stably.
"""

from __future__ import annotations

from urllib.parse import quote

from selfrag.schemas.answer import AnswerResponse, Citation, SegmentOut
from selfrag.schemas.openai import Annotation, URLCitation

PASSAGE_URL_PREFIX = "selfrag://passage/"


def passage_url(citation: Citation) -> str:
    """The URL a client links the citation to."""
    return citation.url or PASSAGE_URL_PREFIX + quote(citation.passage_id, safe="")


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
        return text, annotation(segment.citation, start, end)


def annotation(citation: Citation, start: int, end: int) -> Annotation:
    return Annotation(
        url_citation=URLCitation(
            start_index=start,
            end_index=end,
            url=passage_url(citation),
            title=citation.title or citation.passage_id,
        )
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
