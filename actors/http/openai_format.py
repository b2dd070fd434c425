"""OpenAI's response side for the compatible routes (actors/http/openai_routes.py): its error
envelope
(`OpenAIError`, and answer-path failures as OpenAI errors), a response's finish reason and
usage, and the stream format (`OpenAIStreamFormat`: a chunk per segment, then the final chunk,
the optional usage chunk and `data: [DONE]`)."""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from selfrag.actors.http.citations import AnswerText, cited_urls
from selfrag.actors.http.streaming import sse
from selfrag.schemas.answer import AnswerResponse, SegmentOut
from selfrag.schemas.errors import AnswerError
from selfrag.schemas.events import SegmentEvent
from selfrag.schemas.openai import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChunkDelta,
    Completion,
    CompletionUsage,
    DeltaAnnotation,
    FinishReason,
    OpenAIErrorBody,
    OpenAIErrorDetail,
    StreamedSegment,
    TextChoice,
)

DONE = b"data: [DONE]\n\n"


class OpenAIError(Exception):
    """A failure on an OpenAI route, in OpenAI's terms."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = OpenAIErrorBody(
            error=OpenAIErrorDetail(
                message=message, type=error_type(status), param=param, code=code
            )
        )
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            self.body.model_dump(mode="json"), status_code=self.status, headers=self.headers
        )


def error_type(status: int) -> str:
    """OpenAI's error `type` for a status."""
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def from_answer_error(exc: AnswerError, rid: str, retry_after_s: int) -> OpenAIError:
    """An answer-path failure: a request the system cannot answer is a 400 here (OpenAI
    has no 422); an internal error says only where to look in the log."""
    status = 400 if exc.status == 422 else exc.status
    message = str(exc.detail)
    if exc.status == 500 and exc.kind == "internal_error":
        message = f"internal error; request id {rid}"
    headers = {"Retry-After": str(retry_after_s)} if status == 503 else None
    return OpenAIError(status, message, code=exc.kind, headers=headers)


def finish_reason(response: AnswerResponse) -> FinishReason:
    """`length` when a budget ended the answer or it used every token it was allowed."""
    cfg, segments = response.config, response.segments
    if response.usage.stopped_by is not None:
        return "length"
    spent = sum(s.n_tokens for s in segments)
    last_full = bool(segments) and segments[-1].n_tokens >= cfg.max_segment_tokens
    full = spent >= cfg.answer_budget or (len(segments) == cfg.max_segments and last_full)
    return "length" if full else "stop"


def usage_of(response: AnswerResponse) -> CompletionUsage:
    u = response.usage
    return CompletionUsage(
        prompt_tokens=u.prefill_tokens,
        completion_tokens=u.decode_tokens,
        total_tokens=u.prefill_tokens + u.decode_tokens,
    )


class OpenAIStreamFormat:
    """Chunks of a chat or text completion: one per segment as it is decoded (segments only
    ever append: with beam > 1 they wait for the answer), the answer's closing chunk, an
    optional usage chunk, then `[DONE]`."""

    def __init__(
        self,
        kind: Literal["chat", "text"],
        *,
        completion_id: str,
        created: int,
        model: str,
        hold: bool,
        include_usage: bool,
        retry_after_s: int,
    ) -> None:
        self._kind = kind
        self._id, self._created, self._model = completion_id, created, model
        self._hold = hold
        self._include_usage = include_usage
        self._retry_after_s = retry_after_s
        self._sent = 0  # segments streamed
        self._text = AnswerText()  # what they joined into, for the annotations' indexes
        self._annotated = 0  # annotations streamed
        self._began = False

    def _chunk(
        self,
        text: str | None,
        *,
        finish: FinishReason | None = None,
        selfrag: StreamedSegment | AnswerResponse | None = None,
        usage: CompletionUsage | None = None,
        no_choice: bool = False,
        annotation: DeltaAnnotation | None = None,
        citations: list[str] | None = None,
    ) -> bytes:
        model: BaseModel
        if self._kind == "chat":
            delta = ChunkDelta(content=text, annotations=[annotation] if annotation else None)
            if not self._began:
                delta.role, self._began = "assistant", True
            choices = [ChatChunkChoice(index=0, delta=delta, finish_reason=finish, selfrag=selfrag)]
            model = ChatCompletionChunk(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[] if no_choice else choices,
                usage=usage,
                citations=citations,
            )
        else:
            choice = TextChoice(index=0, text=text or "", finish_reason=finish, selfrag=selfrag)
            model = Completion(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[] if no_choice else [choice],
                usage=usage,
            )
        return sse(None, model.model_dump(mode="json"))

    def _segment(self, index: int, segment: SegmentOut) -> bytes:
        """The chunk of a segment that is final: its text and, in a chat, its annotation."""
        text, found = self._text.append(segment)
        self._sent += 1
        annotation = None
        if found is not None and self._kind == "chat":
            annotation = DeltaAnnotation(index=self._annotated, url_citation=found.url_citation)
            self._annotated += 1
        return self._chunk(
            text, selfrag=StreamedSegment(index=index, segment=segment), annotation=annotation
        )

    def segment(self, event: SegmentEvent) -> bytes:
        # A replaced segment (index below what was sent) cannot be taken back: hold it.
        if self._hold or event.index != self._sent:
            return b""
        return self._segment(event.index, event.segment)

    def final(self, response: AnswerResponse) -> bytes:
        out = []
        if response.abstained:
            text = response.answer if self._sent == 0 else "\n\n" + response.answer
            out.append(self._chunk(text))
        else:
            for i in range(self._sent, len(response.segments)):
                out.append(self._segment(i, response.segments[i]))
        citations = cited_urls(response) if self._kind == "chat" else None
        out.append(
            self._chunk(None, finish=finish_reason(response), selfrag=response, citations=citations)
        )
        if self._include_usage:
            out.append(self._chunk(None, usage=usage_of(response), no_choice=True))
        return b"".join(out)

    def error(self, exc: AnswerError, rid: str) -> bytes:
        failure = from_answer_error(exc, rid, self._retry_after_s)
        return sse(None, failure.body.model_dump(mode="json"))

    def end(self) -> bytes:
        return DONE

    def error_response(self, exc: AnswerError, rid: str) -> Response:
        return from_answer_error(exc, rid, self._retry_after_s).response()
