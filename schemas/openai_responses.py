"""The OpenAI-compatible API's response types: chat completions and their stream chunks, text
completions, `/v1/models`, the `url_citation` annotations and OpenAI's error body."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from selfrag.schemas.answer import AnswerResponse, SegmentFlag, SegmentOut

FinishReason = Literal["stop", "length"]


class CompletionUsage(BaseModel):
    """Tokens the engine computed for the answer: every branch's prompt and draft, so the
    cost of Self-RAG's branching shows (`selfrag.usage` breaks it down)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class URLCitation(BaseModel):
    """What a `url_citation` annotation cites, and the span of the answer text citing it."""

    start_index: int = Field(description="First character of the citing segment in the text.")
    end_index: int = Field(description="Just past its last character (a Python slice end).")
    url: str = Field(description="The document's own URL, else selfrag://passage/<id>.")
    title: str = Field(description="The passage's title, else its id.")


class Annotation(BaseModel):
    """OpenAI's `url_citation` annotation: one per cited segment (`actors/http/citations.py`)."""

    type: Literal["url_citation"] = "url_citation"
    url_citation: URLCitation
    flags: list[SegmentFlag] | None = Field(
        None,
        description="Extension: what a reader should check in the citing segment "
        "(`SegmentOut.flags`); left out when there is nothing to check.",
    )

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null(handler(self), "flags")


class DeltaAnnotation(Annotation):
    """An annotation in a stream chunk's delta. `index` is its place in the message's
    annotations: the `openai` client's stream helper merges list entries by it."""

    index: int


def _without_null(data: dict[str, Any], *fields: str) -> dict[str, Any]:
    """`data` without those of `fields` that are None: an extension field clients need not
    know is left out rather than sent as null."""
    for name in fields:
        if data.get(name, 0) is None:
            del data[name]
    return data


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    annotations: list[Annotation] = Field(
        default_factory=list, description="A url_citation per cited segment."
    )


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None
    selfrag: AnswerResponse = Field(description="The answer with citations and scores.")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    citations: list[str] = Field(
        default_factory=list,
        description="Perplexity-style: the distinct URLs the answer cites, in order.",
    )


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    annotations: list[DeltaAnnotation] | None = Field(
        None, description="The url_citation of the segment whose text this chunk carries."
    )

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null(handler(self), "annotations")


class StreamedSegment(BaseModel):
    """The segment a chunk's text belongs to, with its citation and scores."""

    index: int
    segment: SegmentOut


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: FinishReason | None = None
    logprobs: None = None
    selfrag: StreamedSegment | AnswerResponse | None = Field(
        None, description="The segment streamed in this chunk; the last chunk: the answer."
    )


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None
    citations: list[str] | None = Field(
        None, description="On the closing chunk: the URLs the answer cites (Perplexity-style)."
    )

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null(handler(self), "citations")


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None
    selfrag: StreamedSegment | AnswerResponse | None = None


class Completion(BaseModel):
    """A `/v1/completions` response, and (with one choice) each of its streamed chunks."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: CompletionUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "selfrag"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """OpenAI's error envelope."""

    error: OpenAIErrorDetail
