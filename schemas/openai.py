"""The OpenAI-compatible API's types: the requests of `/v1/chat/completions` and
`/v1/completions`, and the responses: chat completions and their stream chunks, text
completions, `/v1/models`, the `url_citation` annotations and OpenAI's error body.

Requests accept the standard fields that mean something for Self-RAG decoding, and the dials
in a `selfrag` extension object (a `SelfragExtension`: the `DecodingOverrides` and the
`collection` to answer from; the `openai` client sends it with
`extra_body={"selfrag": {...}}`). A standard field selfrag cannot honour is refused, never
ignored. Every choice carries the full `AnswerResponse` (citations and per-segment scores)
in its `selfrag` field; a chat message carries the citations as OpenAI `url_citation`
annotations too, and a chat completion as a Perplexity-style top-level `citations` list.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from selfrag.schemas.answer import AnswerResponse, SegmentFlag, SegmentOut
from selfrag.schemas.decoding import MAX_ANSWER_TOKENS, DecodingOverrides
from selfrag.schemas.settings import COLLECTION_NAME
from selfrag.schemas.text import has_visible_text

MAX_MESSAGES = 64
MAX_PROMPTS = 8
"""Prompts one `/v1/completions` request may hold; they are answered concurrently."""


class TextPart(BaseModel):
    """A text part of a message's content (images and audio are refused)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)

    @property
    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class SelfragExtension(DecodingOverrides):
    """The `selfrag` extension object of a completion request: the dials, and the collection."""

    collection: str | None = Field(
        None,
        pattern=COLLECTION_NAME,
        description="The index collection to answer from (default: the served one); "
        "`AnswerRequest.collection`.",
    )

    def dials(self) -> dict[str, Any]:
        """The `DecodingOverrides` fields the request set."""
        return self.model_dump(exclude_none=True, exclude={"collection"})


def _refuse(value: Any, allowed: tuple[Any, ...], why: str) -> Any:
    if value not in allowed:
        raise ValueError(why)
    return value


class _CompletionFields(BaseModel):
    """What both completion endpoints accept."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(
        None,
        ge=4,
        le=MAX_ANSWER_TOKENS,
        description="Caps the answer's tokens (max_answer_tokens, and each segment's; at "
        "most max_segments × max_segment_tokens at their bounds, the longest answer there is).",
    )
    temperature: float | None = Field(
        None,
        ge=0.0,
        le=2.0,
        description="Sampling temperature of the drafts (0, the default: greedy); the "
        "critique's reads stay deterministic.",
    )
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="Nucleus sampling of the drafts (temperature > 0)."
    )
    n: int | None = Field(None, description="One choice per prompt: only 1 is accepted.")
    stop: str | list[str] | None = Field(None, description="Not supported: segments end the text.")
    presence_penalty: float | None = Field(None, description="Only 0 is accepted.")
    frequency_penalty: float | None = Field(None, description="Only 0 is accepted.")
    seed: int | None = Field(
        None,
        ge=-(2**63),
        lt=2**64,
        description="The same seed and request give the same answer (with temperature > 0).",
    )
    user: str | None = Field(None, max_length=256, description="Accepted and not used.")
    selfrag: SelfragExtension = Field(
        default_factory=SelfragExtension,
        description="Self-RAG dials for this request, and the collection to answer from.",
    )

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        return _refuse(v, (None, 1), "n must be 1: selfrag returns its best answer")

    def sampling_overrides(self) -> dict[str, Any]:
        """The sampling parameters the client set, as `DecodingOverrides` fields (a seed
        folded into the non-negative range)."""
        out: dict[str, Any] = {}
        if self.temperature is not None:
            out["temperature"] = self.temperature
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.seed is not None:
            out["seed"] = self.seed % 2**63
        return out

    @field_validator("stop")
    @classmethod
    def _no_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        return _refuse(v or None, (None,), "stop sequences are not supported")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        return _refuse(v, (None, 0), "penalties are not supported; use 0 or omit it")


class ChatCompletionRequest(_CompletionFields):
    """`POST /v1/chat/completions`. The question is the last user message; the turns before
    it become the question's context (see `actors/http/openai_requests.py`)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(
        None, ge=4, le=MAX_ANSWER_TOKENS, description="Same as max_tokens."
    )
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        return _refuse(v, (None, False), "logprobs are not returned; see choices[].selfrag")

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        return _refuse(v, (None, 0), "logprobs are not returned; see choices[].selfrag")

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        return _refuse(v or None, (None,), "tools are not supported")

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        return _refuse(v, (None, "none"), "tools are not supported")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    @field_validator("messages")
    @classmethod
    def _has_user_message(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.role == "user" and has_visible_text(m.text) for m in v):
            raise ValueError("messages must contain a user message with visible text")
        return v

    @property
    def token_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def token_param(self) -> str:
        """The field `token_cap` came from, as the client named it."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class CompletionRequest(_CompletionFields):
    """`POST /v1/completions`: each prompt is a question."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        return _refuse(v, (None, False), "echo is not supported")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        return _refuse(v, (None, 0), "logprobs are not returned; see choices[].selfrag")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        return _refuse(v or None, (None,), "suffix is not supported")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        return _refuse(v, (None, 1), "best_of must be 1")

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @property
    def token_cap(self) -> int | None:
        return self.max_tokens

    @property
    def token_param(self) -> str:
        """The field `token_cap` came from."""
        return "max_tokens"


# --- responses -----------------------------------------------------------------------------

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
