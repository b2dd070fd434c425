"""Reading an OpenAI-compatible request into the answer path's `AnswerRequest`: the body
parsed, the conversation turned into one question, the system messages into instructions,
and every refusal a 400 naming the field as the client sent it."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from selfrag.actors.http.openai_format import OpenAIError
from selfrag.schemas.answer import MAX_QUESTION_CHARS, AnswerRequest
from selfrag.schemas.decoding import MAX_INSTRUCTIONS_CHARS
from selfrag.schemas.openai import ChatCompletionRequest, ChatMessage, CompletionRequest

_TURN = {"user": "User", "assistant": "Assistant"}


Loc = tuple[int | str, ...]


def dotted(loc: Loc) -> str:
    """A pydantic error location as a field path: `selfrag.top_k`, `messages.0.content`."""
    return ".".join(str(p) for p in loc)


def invalid(exc: ValidationError, field: Callable[[Loc], str] = dotted) -> OpenAIError:
    """A 400 naming the first offending field (OpenAI's `param`, as `field` names a pydantic
    location) and every problem."""
    errors = exc.errors()
    problems = [f"{field(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg', '')}" for e in errors]
    param = field(tuple(errors[0].get("loc", ()))) if errors else ""
    return OpenAIError(400, "; ".join(problems), code="invalid_request", param=param or None)


def conversation_question(messages: Sequence[ChatMessage]) -> str:
    """The question the answer path gets: the last user message, after the earlier user and
    assistant turns that fit (most recent first) within `MAX_QUESTION_CHARS`."""
    last = max(i for i, m in enumerate(messages) if m.role == "user" and m.text.strip())
    if any(m.role == "assistant" for m in messages[last + 1 :]):
        raise OpenAIError(400, "the conversation must end with a user message", param="messages")
    question = messages[last].text.strip()
    if len(question) > MAX_QUESTION_CHARS:
        raise OpenAIError(
            400,
            f"the last user message has {len(question)} characters; "
            f"the limit is {MAX_QUESTION_CHARS}",
            code="question_too_long",
            param=f"messages.{last}.content",
        )
    turns = [
        f"{_TURN[m.role]}: {' '.join(m.text.split())}"
        for m in messages[:last]
        if m.role in _TURN and m.text.strip()
    ]
    head, tail = "Conversation so far:\n", f"\nQuestion: {question}"
    budget = MAX_QUESTION_CHARS - len(head) - len(tail)
    kept: list[str] = []
    for turn in reversed(turns):
        if len(turn) + 1 > budget:
            break
        kept.insert(0, turn)
        budget -= len(turn) + 1
    return head + "\n".join(kept) + tail if kept else question


def system_instructions(messages: Sequence[ChatMessage]) -> str | None:
    """The system and developer messages' text, one after another: what the drafts follow."""
    texts = [m.text.strip() for m in messages if m.role in ("system", "developer")]
    joined = "\n".join(t for t in texts if t)
    if len(joined) > MAX_INSTRUCTIONS_CHARS:
        raise OpenAIError(
            400,
            f"the system messages have {len(joined)} characters; "
            f"the limit is {MAX_INSTRUCTIONS_CHARS}",
            code="instructions_too_long",
            param="messages",
        )
    return joined or None


Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The request's JSON body as `model`; every way it fails is a 400 in OpenAI's terms."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    except (RecursionError, ValueError):  # ValueError: an integer over int_max_str_digits
        raise OpenAIError(
            400,
            "the body is not JSON this server reads: nested too deeply or a number too long",
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the body must be a JSON object", code="invalid_request")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc) from exc


def to_answer_request(
    question: str,
    body: ChatCompletionRequest | CompletionRequest,
    question_param: str,
    instructions: str | None = None,
) -> AnswerRequest:
    """The answer path's request; a refusal names the field as the client sent it: the
    question as `question_param` (`prompt`, `prompt.1`, `messages`), the dials under
    `selfrag` (the collection as `selfrag.collection`), the token cap as `max_tokens` or
    `max_completion_tokens`. The sampling parameters and `instructions` apply unless the
    `selfrag` object sets them itself."""

    def field(loc: Loc) -> str:
        head, rest = (loc[0], loc[1:]) if loc else ("", ())
        if head == "question":
            return question_param
        if head == "config":
            return dotted(("selfrag", *rest))
        if head == "collection":
            return "selfrag.collection"
        if head == "max_tokens":
            return body.token_param
        return dotted(loc)

    try:
        config = body.sampling_overrides()
        if instructions:
            config["instructions"] = instructions
        config.update(body.selfrag.dials())
        return AnswerRequest(
            question=question,
            config=config,
            collection=body.selfrag.collection,
            max_tokens=body.token_cap,
        )
    except ValidationError as exc:
        raise invalid(exc, field) from exc
