"""The OpenAI-compatible routes (actors/http/openai_routes.py) with the official `openai` client and
LangChain's `ChatOpenAI`, against the HTTP app under a real uvicorn socket and a scripted
answer service."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.openai_format import finish_reason
from selfrag.actors.http.openai_requests import conversation_question
from selfrag.actors.http.routes import build_http_app, parse_api_keys
from selfrag.schemas.answer import MAX_QUESTION_CHARS
from selfrag.schemas.decoding import MAX_ANSWER_TOKENS, DecodingConfig
from selfrag.schemas.errors import DeadlineExceeded, Overloaded
from selfrag.schemas.openai import ChatMessage
from tests.http_fakes import FakeService, live_server, scripted_response
from tests.serve_fakes import make_service

KEY = "sk-test-key"


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def url(service: FakeService) -> Iterator[str]:
    app = build_http_app(service, Metrics(), api_keys=parse_api_keys(KEY), retry_after_s=3)
    with live_server(app) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI):
    assert [m.id for m in client.models.list()] == ["selfrag"]
    assert client.models.retrieve("selfrag").id == "selfrag"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_completion_carries_citations_scores_and_dials(
    client: openai.OpenAI, service: FakeService
):
    r = client.chat.completions.create(
        model="selfrag",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Who founded Normandy?"},
        ],
        max_tokens=20,
        extra_body={"selfrag": {"mode": "always", "top_k": 3, "w_sup": 2}},
    )
    seen = service.seen[-1]
    assert seen.question == "Who founded Normandy?"
    assert (seen.config.mode, seen.config.top_k, seen.config.w_sup) == ("always", 3, 2)
    assert seen.max_tokens == 20
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "Rollo founded it. In 911."
    assert choice.finish_reason == "stop"
    extension = choice.model_extra["selfrag"]
    assert extension["segments"][0]["citation"]["passage_id"] == "p1"
    assert extension["segments"][0]["s_sup"] == 0.75
    assert extension["passages"][0]["id"] == "p1"
    assert extension["config"]["max_segment_tokens"] == 20  # max_tokens capped the answer
    assert r.usage is not None and r.object == "chat.completion" and r.model == "selfrag"


def test_the_collection_rides_in_the_selfrag_extension(client: openai.OpenAI, service: FakeService):
    client.chat.completions.create(
        model="selfrag",
        messages=[{"role": "user", "content": "q"}],
        extra_body={"selfrag": {"collection": "docs", "top_k": 2}},
    )
    assert (service.seen[-1].collection, service.seen[-1].config.top_k) == ("docs", 2)
    client.completions.create(model="selfrag", prompt="q", extra_body={"selfrag": {}})
    assert service.seen[-1].collection is None
    client.completions.create(
        model="selfrag", prompt=["a", "b"], extra_body={"selfrag": {"collection": "docs"}}
    )
    assert [s.collection for s in service.seen[-2:]] == ["docs", "docs"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="selfrag",
            messages=[{"role": "user", "content": "q"}],
            extra_body={"selfrag": {"collection": "../escape"}},
        )
    assert _error(e.value)["param"] == "selfrag.collection"


def test_a_collection_the_server_does_not_serve_is_refused_saying_so():
    """The answer service itself (over fakes) serving `passages`: another collection is a
    400 on the OpenAI routes, streamed or not, as it is a 422 on /v1/answer."""
    rig = make_service(collection="passages")
    with live_server(build_http_app(rig.service, rig.metrics)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        chat = {"model": "selfrag", "messages": [{"role": "user", "content": "Who?"}]}
        served = client.chat.completions.create(
            **chat, extra_body={"selfrag": {"collection": "passages", "mode": "never"}}
        )
        assert served.choices[0].message.content
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(
                    **chat, stream=stream, extra_body={"selfrag": {"collection": "other"}}
                )
            error = _error(e.value)
            assert error["code"] == "unprocessable"
            assert "'other'" in error["message"] and "'passages'" in error["message"]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(
                model="selfrag", prompt="Who?", extra_body={"selfrag": {"collection": "other"}}
            )
        native = httpx.post(base + "/v1/answer", json={"question": "Who?", "collection": "other"})
        assert native.status_code == 422 and "'other'" in native.json()["detail"]


def test_chat_stream_sends_each_segment_with_its_citation(client: openai.OpenAI):
    chunks = list(
        client.chat.completions.create(
            model="selfrag",
            messages=[{"role": "user", "content": "Who founded Normandy?"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Rollo founded it. In 911."
    assert chunks[0].choices[0].delta.role == "assistant"
    segments = [
        c.choices[0].model_extra["selfrag"]
        for c in chunks
        if c.choices and c.choices[0].delta.content
    ]
    assert segments[0]["index"] == 0
    assert segments[0]["segment"]["citation"]["passage_id"] == "p1"
    assert segments[1]["segment"]["citation"] is None
    closing = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert closing.choices[0].finish_reason == "stop"
    assert closing.choices[0].model_extra["selfrag"]["answer"] == text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


def test_raw_stream_ends_with_done(url: str):
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={"model": "selfrag", "messages": [{"role": "user", "content": "q"}], "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_a_wide_beam_streams_segments_once_the_answer_is_done(client: openai.OpenAI):
    chunks = list(
        client.chat.completions.create(
            model="selfrag",
            messages=[{"role": "user", "content": "q"}],
            stream=True,
            extra_body={"selfrag": {"beam": 2}},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Rollo founded it. In 911."


def test_completions_answer_every_prompt(client: openai.OpenAI, service: FakeService):
    r = client.completions.create(model="selfrag", prompt=["Who?", "When?"])
    assert [c.index for c in r.choices] == [0, 1]
    assert {s.question for s in service.seen} == {"Who?", "When?"}
    assert r.choices[0].text == "Rollo founded it. In 911."
    assert r.choices[0].model_extra["selfrag"]["segments"][0]["citation"]["passage_id"] == "p1"
    streamed = list(client.completions.create(model="selfrag", prompt="Who?", stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "q"}]}, 404, "model"),
        ({"model": "selfrag", "messages": [{"role": "system", "content": "q"}]}, 400, "messages"),
        ({"model": "selfrag", "messages": []}, 400, "messages"),
        (
            {
                "model": "selfrag",
                "messages": [{"role": "user", "content": "q"}],
                "selfrag": {"top_k": 500},
            },
            400,
            "selfrag.top_k",
        ),
        (
            {
                "model": "selfrag",
                "messages": [{"role": "user", "content": "q"}],
                "temperature": 2.5,
            },
            400,
            "temperature",
        ),
        (
            {"model": "selfrag", "messages": [{"role": "user", "content": "\u200b\x1b\ufeff"}]},
            400,
            "messages",
        ),
        (
            {"model": "selfrag", "messages": [{"role": "user", "content": "q"}], "n": 2},
            400,
            "n",
        ),
        (
            {"model": "selfrag", "messages": [{"role": "user", "content": "q"}], "tools": [{}]},
            400,
            "tools",
        ),
        (
            {"model": "selfrag", "messages": [{"role": "user", "content": "q"}], "bogus": 1},
            400,
            "bogus",
        ),
        (
            {
                "model": "selfrag",
                "messages": [{"role": "user", "content": "x" * (MAX_QUESTION_CHARS + 1)}],
            },
            400,
            "messages.0.content",
        ),
        (
            {
                "model": "selfrag",
                "messages": [{"role": "user", "content": "q"}],
                "max_tokens": MAX_ANSWER_TOKENS + 1,
            },
            400,
            "max_tokens",
        ),
        (
            {
                "model": "selfrag",
                "messages": [{"role": "user", "content": "q"}],
                "max_completion_tokens": 10**9,
            },
            400,
            "max_completion_tokens",
        ),
    ],
)
def test_bad_requests_get_openais_envelope_naming_the_field(url: str, body, status, param):
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] in ("invalid_request_error", "not_found_error")
    assert error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x" * (MAX_QUESTION_CHARS + 1)}, "prompt"),
        ({"prompt": ["q", "x" * (MAX_QUESTION_CHARS + 1)]}, "prompt.1"),
        ({"prompt": "  "}, "prompt"),
        ({"prompt": "\u200b\x1b\u2066"}, "prompt"),
        ({"prompt": "q", "max_tokens": MAX_ANSWER_TOKENS + 1}, "max_tokens"),
        ({"prompt": "q", "selfrag": {"beam": 9}}, "selfrag.beam"),
    ],
)
def test_completions_errors_name_the_field_as_it_was_sent(url: str, body, param):
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "selfrag", **body},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ": "), error
    assert ".question" not in error["message"] and ".max_tokens" not in error["message"]


def test_the_token_caps_bound_is_the_longest_answer_and_documented(url: str):
    """A cap above max_segments × max_segment_tokens at their bounds could not change an
    answer; the OpenAPI document shows the bound."""
    assert DecodingConfig(max_segments=32, max_segment_tokens=512).within_tokens(
        MAX_ANSWER_TOKENS
    ) == DecodingConfig(max_segments=32, max_segment_tokens=512)
    spec = httpx.get(url + "/openapi.json").json()
    schema = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    props = schema["application/json"]["schema"]["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        typed = next(o for o in props[name]["anyOf"] if o.get("type") == "integer")
        assert typed["maximum"] == MAX_ANSWER_TOKENS, name


DEEP = b'{"model": "selfrag", "prompt": "q", "selfrag": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
HUGE_INT = b'{"model": "selfrag", "prompt": "q", "max_tokens": ' + b"9" * 5_000 + b"}"


@pytest.mark.parametrize("body", [DEEP, HUGE_INT], ids=["deeply-nested", "huge-integer"])
def test_json_the_parser_refuses_is_400_without_a_traceback(
    url: str, body: bytes, caplog: pytest.LogCaptureFixture
):
    caplog.set_level("INFO")
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(
            url + path,
            content=body,
            headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert not [x for x in caplog.records if x.exc_info or x.levelname == "ERROR"]


def test_the_official_client_raises_typed_errors(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "q"}])
    assert _error(e.value)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="selfrag",
            messages=[{"role": "user", "content": "q"}],
            extra_body={"selfrag": {"w_sup": -1}},
        )
    assert _error(e.value)["param"] == "selfrag.w_sup"


def test_oversized_body_is_413_in_the_envelope(url: str):
    r = httpx.post(
        url + "/v1/chat/completions",
        content=b"x" * 70_000,
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"
    assert "65536" in r.json()["error"]["message"]


def test_bad_json_is_400(url: str):
    r = httpx.post(
        url + "/v1/completions",
        content=b'{"model": ',
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_auth_takes_a_bearer_key_and_refuses_others(url: str):
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert _error(e.value)["type"] == "authentication_error"


def test_service_failures_keep_their_status_and_retry_after(url: str, service: FakeService):
    service.fail = Overloaded("busy")
    body = {"model": "selfrag", "messages": [{"role": "user", "content": "q"}]}
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert r.json()["error"] == {
        "message": "busy",
        "type": "server_error",
        "param": None,
        "code": "overloaded",
    }
    # A stream that fails before its first chunk still has its own status.
    service.fail = DeadlineExceeded("too slow")
    r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"


def test_conversation_turns_become_the_questions_context():
    messages = [
        ChatMessage(role="system", content="ignored"),
        ChatMessage(role="user", content="Who founded Normandy?"),
        ChatMessage(role="assistant", content="Rollo."),
        ChatMessage(role="user", content=[{"type": "text", "text": "When was he born?"}]),
    ]
    q = conversation_question(messages)
    assert q == (
        "Conversation so far:\nUser: Who founded Normandy?\nAssistant: Rollo.\n"
        "Question: When was he born?"
    )
    assert "ignored" not in q
    # Only the most recent turns that fit are kept; the question always is.
    long = [ChatMessage(role="user", content="old " * 600), *messages[1:]]
    q = conversation_question(long)
    assert len(q) <= MAX_QUESTION_CHARS and "old" not in q and q.endswith("he born?")
    assert conversation_question([ChatMessage(role="user", content=" hi ")]) == "hi"


def test_max_tokens_lowers_the_answer_budget_and_the_segments_to_fit_it():
    cfg = DecodingConfig(max_segments=3, max_segment_tokens=48)
    assert (cfg.within_tokens(100).max_answer_tokens, cfg.within_tokens(100).answer_budget) == (
        100,
        100,
    )
    assert cfg.within_tokens(100).max_segment_tokens == 48
    short = cfg.within_tokens(20)
    assert (short.max_segment_tokens, short.max_answer_tokens, short.max_segments) == (20, 20, 3)
    assert cfg.within_tokens(1000) == cfg
    assert cfg.answer_budget == 3 * 48  # three segments hold less than max_answer_tokens


def test_an_answer_that_spent_its_token_budget_finishes_for_length():
    # The scripted answer holds two segments of four tokens each.
    spent = scripted_response("q", DecodingConfig(max_answer_tokens=8))
    assert finish_reason(spent) == "length"
    room = scripted_response("q", DecodingConfig(max_answer_tokens=9))
    assert finish_reason(room) == "stop"
    assert (
        finish_reason(scripted_response("q", DecodingConfig(max_segments=2, max_segment_tokens=4)))
        == "length"
    )


def test_langchain_chat_openai_talks_to_it(url: str):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="selfrag", base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert llm.invoke("Who founded Normandy?").content == "Rollo founded it. In 911."
    streamed = "".join(str(chunk.content) for chunk in llm.stream("Who founded Normandy?"))
    assert streamed == "Rollo founded it. In 911."
