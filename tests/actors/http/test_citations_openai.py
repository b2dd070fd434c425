"""Citations on `/v1/chat/completions` in the shapes clients render (actors/http/citations.py):
OpenAI `url_citation` annotations, parsed by the official `openai` client, streamed or not,
and the Perplexity-style top-level `citations` list where LobeChat reads it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.routes import build_http_app, parse_api_keys
from selfrag.schemas.answer import AnswerResponse, Citation
from selfrag.schemas.decoding import DecodingConfig
from tests.http_fakes import FakeService, live_server, scripted_response

KEY = "sk-test-key"
ROLLO = "https://en.wikipedia.org/wiki/Rollo"
CITED = [(0, 17, ROLLO, "T"), (18, 25, "selfrag://passage/squad%3ANormans%2F2", "squad:Normans/2")]
"""(start_index, end_index, url, title) of each annotation of "Rollo founded it. In 911."."""
URLS = [ROLLO, CITED[1][2]]


def _both_cited(question: str, config: DecodingConfig) -> AnswerResponse:
    """The scripted answer with both segments cited: one passage with its document's URL,
    one without a URL or title (and an id that needs escaping in a URL)."""
    r = scripted_response(question, config)
    first, second = r.segments
    r.segments = [
        first.model_copy(update={"citation": Citation(passage_id="p1", title="T", url=ROLLO)}),
        second.model_copy(update={"citation": Citation(passage_id="squad:Normans/2")}),
    ]
    return r


@pytest.fixture
def url() -> Iterator[str]:
    service = FakeService(script=_both_cited)
    app = build_http_app(service, Metrics(), api_keys=parse_api_keys(KEY))
    with live_server(app) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def _spans(annotations: list) -> list[tuple[int, int, str, str]]:
    return [
        (
            a.url_citation.start_index,
            a.url_citation.end_index,
            a.url_citation.url,
            a.url_citation.title,
        )
        for a in annotations
    ]


QUESTION = [{"role": "user", "content": "Who founded Normandy?"}]


def test_the_message_annotates_each_cited_segment(client: openai.OpenAI):
    r = client.chat.completions.create(model="selfrag", messages=QUESTION)
    message = r.choices[0].message
    assert message.content == "Rollo founded it. In 911."
    assert [a.type for a in message.annotations] == ["url_citation"] * 2
    assert _spans(message.annotations) == CITED
    assert [message.content[s:e] for s, e, _, _ in CITED] == ["Rollo founded it.", "In 911."]
    # Perplexity-style: the distinct URLs cited, in order.
    assert r.model_extra["citations"] == URLS


def test_a_stream_sends_each_annotation_with_its_segment(client: openai.OpenAI):
    text, seen = "", []
    for chunk in client.chat.completions.create(model="selfrag", messages=QUESTION, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for a in delta.model_extra.get("annotations") or []:
            # Indexes into the text streamed so far, over the text this very chunk carried.
            span = text[a["url_citation"]["start_index"] : a["url_citation"]["end_index"]]
            assert span == delta.content.strip()
            seen.append(a)
        if chunk.choices[0].finish_reason:
            assert chunk.model_extra["citations"] == URLS
        else:
            assert "citations" not in chunk.model_extra
    assert [a["index"] for a in seen] == [0, 1]
    assert [tuple(a["url_citation"].values()) for a in seen] == CITED
    # The client's stream helper merges them into the final message, as it does OpenAI's.
    with client.chat.completions.stream(model="selfrag", messages=QUESTION) as stream:
        final = stream.get_final_completion().choices[0].message
    assert final.content == "Rollo founded it. In 911." and _spans(final.annotations) == CITED


def test_a_held_stream_annotates_the_final_segments(client: openai.OpenAI):
    """With beam > 1 the leader can change: segments, annotations with them, wait for the
    answer."""
    with client.chat.completions.stream(
        model="selfrag", messages=QUESTION, extra_body={"selfrag": {"beam": 2}}
    ) as stream:
        final = stream.get_final_completion().choices[0].message
    assert _spans(final.annotations) == CITED


def test_the_closing_chunk_carries_the_citations_where_lobechat_reads_them(url: str):
    """LobeChat's OpenAI stream reader takes a chunk's top-level `citations` (URLs) from a
    chunk with `finish_reason` and no content, annotations or usage."""
    body = {"model": "selfrag", "messages": QUESTION, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    *segments, closing = chunks
    assert closing["choices"][0]["finish_reason"] == "stop"
    assert closing["citations"] == URLS
    assert closing["choices"][0]["delta"] == {"role": None, "content": None}
    assert closing.get("usage") is None
    # Left out, not null, where there is nothing to say.
    assert all("citations" not in c for c in segments)
    assert ["annotations" in c["choices"][0]["delta"] for c in segments] == [True, True]
