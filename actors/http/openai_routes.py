"""OpenAI-compatible routes on the HTTP app: `GET /v1/models`, `GET /v1/models/{id}`,
`POST /v1/chat/completions` and `POST /v1/completions`, streamed or not.

Each request becomes one `AnswerRequest` on the same answer client as `/v1/answer`:
- the question is the last user message; earlier user and assistant turns are prefixed to
  it as the conversation so far (the most recent that fit in `MAX_QUESTION_CHARS`), so
  retrieval and drafting both see them; system and developer messages are instructions the
  drafts follow (`DecodingConfig.instructions`: the answer's language, tone), while the
  prompt head stays selfrag's own, shared by every branch so its KV state is reusable;
- `temperature`, `top_p` and `seed` sample the drafts (greedy at 0, the default); the
  critique's reads stay deterministic;
- `max_tokens` / `max_completion_tokens` cap the answer (`DecodingConfig.within_tokens`);
- the dials come in the `selfrag` extension object (`DecodingOverrides`), with the
  `collection` to answer from (a server answers from its own only: another is a 400).
Each choice carries the `AnswerResponse` in `selfrag`; `usage` counts every token the engine
computed (all branches). A chat message's citations are also OpenAI `url_citation`
annotations, and the completion's top-level `citations` lists their URLs
(`actors/http/citations.py`).
A stream sends one chunk per segment with the segment (its citation and scores) in `selfrag`
and, in a chat, its annotation in `delta.annotations`, as it is decoded (with `beam` > 1 the
leader can change, so the segments come when the answer is done), then a chunk with
`finish_reason`, the answer and `citations`, and `data: [DONE]`. Errors use OpenAI's envelope
`{"error": {message, type, param, code}}`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from selfrag.actors.http.citations import annotations, cited_urls
from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.openai_format import (
    OpenAIError,
    OpenAIStreamFormat,
    finish_reason,
    from_answer_error,
    usage_of,
)
from selfrag.actors.http.openai_requests import (
    conversation_question,
    parse_body,
    system_instructions,
    to_answer_request,
)
from selfrag.actors.http.streaming import AnswerLog, AnswerStream, request_id
from selfrag.runtime.answer_client import AnswerClient
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.errors import AnswerError
from selfrag.schemas.openai import ChatCompletionRequest, CompletionRequest
from selfrag.schemas.openai_responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionUsage,
    ModelCard,
    ModelList,
    TextChoice,
)

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


def is_openai_path(path: str) -> bool:
    """Whether errors on `path` use OpenAI's envelope."""
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


class _Routes:
    """What the OpenAI-compatible routes share: the service, the served model's card, the
    answer log and the stream settings."""

    def __init__(
        self,
        service: AnswerClient,
        metrics: Metrics,
        *,
        model_name: str,
        log_answer: AnswerLog,
        keepalive_s: float,
        retry_after_s: int,
    ) -> None:
        self.service = service
        self.metrics = metrics
        self.model_name = model_name
        self.card = ModelCard(id=model_name, created=int(time.time()))
        self.log_answer = log_answer
        self.keepalive_s = keepalive_s
        self.retry_after_s = retry_after_s

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise OpenAIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                code="model_not_found",
                param="model",
            )

    async def answer_one(self, request: Request, body: AnswerRequest) -> AnswerResponse:
        started, rid = time.perf_counter(), request_id(request)
        try:
            result = await self.service.aanswer(body)
        except AnswerError as exc:
            self.log_answer(body.question, exc.status, started, rid)
            raise from_answer_error(exc, rid, self.retry_after_s) from exc
        self.log_answer(body.question, 200, started, rid)
        return result.response

    async def stream(
        self,
        request: Request,
        body: AnswerRequest,
        kind: Literal["chat", "text"],
        options: ChatCompletionRequest | CompletionRequest,
        completion_id: str,
    ) -> Response:
        try:
            config = await self.service.aconfig(body)
        except AnswerError as exc:
            raise from_answer_error(exc, request_id(request), self.retry_after_s) from exc
        fmt = OpenAIStreamFormat(
            kind,
            completion_id=completion_id,
            created=int(time.time()),
            model=self.model_name,
            hold=config.beam > 1,
            include_usage=bool(options.stream_options and options.stream_options.include_usage),
            retry_after_s=self.retry_after_s,
        )
        return await AnswerStream(
            self.service,
            body,
            request,
            fmt,
            log_answer=self.log_answer,
            metrics=self.metrics,
            keepalive_s=self.keepalive_s,
            config=config,
        ).respond()

    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        self.check_model(body.model)
        answer_request = to_answer_request(
            conversation_question(body.messages),
            body,
            "messages",
            system_instructions(body.messages),
        )
        completion_id = f"chatcmpl-{request_id(request)}"
        if body.stream:
            return await self.stream(request, answer_request, "chat", body, completion_id)
        response = await self.answer_one(request, answer_request)
        completion = ChatCompletion(
            id=completion_id,
            created=int(time.time()),
            model=self.model_name,
            choices=[
                ChatChoice(
                    index=0,
                    message=AssistantMessage(
                        content=response.answer, annotations=annotations(response)
                    ),
                    finish_reason=finish_reason(response),
                    selfrag=response,
                )
            ],
            usage=usage_of(response),
            citations=cited_urls(response),
        )
        return JSONResponse(completion.model_dump(mode="json"))

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        self.check_model(body.model)
        single = isinstance(body.prompt, str)
        requests = [
            to_answer_request(p, body, "prompt" if single else f"prompt.{i}")
            for i, p in enumerate(body.prompts)
        ]
        completion_id = f"cmpl-{request_id(request)}"
        if body.stream:
            if len(requests) > 1:
                raise OpenAIError(
                    400, "stream needs a single prompt", code="invalid_request", param="prompt"
                )
            return await self.stream(request, requests[0], "text", body, completion_id)
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the other prompts
                tasks = [group.create_task(self.answer_one(request, r)) for r in requests]
        except* OpenAIError as failures:
            raise failures.exceptions[0] from None
        responses = [t.result() for t in tasks]
        total = CompletionUsage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        for r in responses:
            u = usage_of(r)
            total.prompt_tokens += u.prompt_tokens
            total.completion_tokens += u.completion_tokens
            total.total_tokens += u.total_tokens
        completion = Completion(
            id=completion_id,
            created=int(time.time()),
            model=self.model_name,
            choices=[
                TextChoice(index=i, text=r.answer, finish_reason=finish_reason(r), selfrag=r)
                for i, r in enumerate(responses)
            ],
            usage=total,
        )
        return JSONResponse(completion.model_dump(mode="json"))


def _json_body(schema: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its JSON itself (`parse_body`)."""
    return {
        "requestBody": {
            "content": {"application/json": {"schema": schema.model_json_schema()}},
            "required": True,
        }
    }


def add_openai_routes(
    app: FastAPI,
    service: AnswerClient,
    metrics: Metrics,
    *,
    model_name: str,
    authed: Sequence[Any],
    posted: Sequence[Any],
    log_answer: AnswerLog,
    keepalive_s: float,
    retry_after_s: int,
) -> None:
    """Register the OpenAI-compatible routes on `app`: GETs behind `authed`, POSTs behind
    `posted` (the key and the JSON content type)."""
    routes = _Routes(
        service,
        metrics,
        model_name=model_name,
        log_answer=log_answer,
        keepalive_s=keepalive_s,
        retry_after_s=retry_after_s,
    )

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.get("/v1/models", dependencies=authed, response_model=ModelList)
    async def list_models() -> ModelList:
        """The one model this server serves (`serve.model_name`)."""
        return ModelList(data=[routes.card])

    @app.get("/v1/models/{model}", dependencies=authed, response_model=ModelCard)
    async def get_model(model: str) -> ModelCard:
        routes.check_model(model)
        return routes.card

    streams = {200: {"content": {"text/event-stream": {}}}}

    @app.post(
        "/v1/chat/completions",
        dependencies=posted,
        response_model=ChatCompletion,
        responses=streams,
        openapi_extra=_json_body(ChatCompletionRequest),
    )
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions: the last user message is the question."""
        return await routes.chat_completions(request)

    @app.post(
        "/v1/completions",
        dependencies=posted,
        response_model=Completion,
        responses=streams,
        openapi_extra=_json_body(CompletionRequest),
    )
    async def completions(request: Request) -> Response:
        """OpenAI (legacy) completions: each prompt is a question, answered concurrently."""
        return await routes.completions(request)
