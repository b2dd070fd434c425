"""A LangChain chat model over an answer client (`runtime.answer_client.AnswerClient`, or a
`selfrag.SelfRAG`'s): the last user message is the question, system messages are instructions
the drafts follow, the reply's `response_metadata` holds its citations (and the full
`AnswerResponse` under `selfrag`); `stream` yields the answer's text segment by segment.

    model = SelfRAGChatModel(rag=SelfRAG.open(home="~/rag"), dials={"top_k": 3})
    reply = model.invoke([("system", "Answer in French."), ("human", "Who founded Normandy?")])
    for chunk in model.stream("Who founded Normandy?"):
        print(chunk.content, end="")
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from pydantic import AliasChoices, Field, field_validator

from selfrag.integrations.sources import answer_client
from selfrag.runtime.answer_client import AnswerClient
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.events import SegmentEvent

try:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForLLMRun,
        CallbackManagerForLLMRun,
    )
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import (
        AIMessage,
        AIMessageChunk,
        BaseMessage,
        HumanMessage,
        SystemMessage,
    )
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
except ImportError as exc:  # the extra is not installed
    raise ImportError(
        "selfrag.integrations.langchain_chat needs langchain-core: install selfrag with its "
        "'langchain' extra (pip install '.[langchain]' in the checkout)"
    ) from exc

__all__ = ["SelfRAGChatModel", "citations", "reply_metadata"]


def citations(response: AnswerResponse) -> list[dict[str, Any]]:
    """One entry per cited segment: its index and text, the passage's id, title, URL and page,
    and the passage text (from the response's passages)."""
    texts = {p.id: p.text for p in response.passages}
    out = []
    for i, s in enumerate(response.segments):
        if s.citation is None:
            continue
        c = s.citation
        out.append(
            {
                "segment": i,
                "segment_text": s.text.strip(),
                "passage_id": c.passage_id,
                "title": c.title,
                "url": c.url,
                "page": c.page,
                "passage_text": texts.get(c.passage_id),
            }
        )
    return out


def reply_metadata(response: AnswerResponse) -> dict[str, Any]:
    """A reply's `response_metadata`: `citations`, `abstained`, `support` and the
    `support_threshold` it was held to, `model_name` and the whole response (`selfrag`,
    JSON-ready)."""
    return {
        "citations": citations(response),
        "abstained": response.abstained,
        "support": response.support,
        "support_threshold": response.support_threshold,
        "model_name": response.model_id,
        "selfrag": response.model_dump(mode="json"),
    }


def _question(messages: Sequence[BaseMessage]) -> tuple[str, str | None]:
    """The last user message's text, and the system messages' text as instructions."""
    users = [m for m in messages if isinstance(m, HumanMessage) and m.text.strip()]
    if not users:
        raise ValueError("SelfRAGChatModel needs a user message with text")
    system = "\n".join(m.text.strip() for m in messages if isinstance(m, SystemMessage))
    return users[-1].text.strip(), system.strip() or None


class SelfRAGChatModel(BaseChatModel):
    """Self-RAG as a LangChain chat model. `client` (or `rag`): the `AnswerClient` it answers
    with, or a `SelfRAG` (its `client`). `dials` are `DecodingConfig` fields (and `max_tokens`,
    `collection`) for every answer; keyword arguments of a call (`model.invoke(q, top_k=2)`)
    override them. With a beam wider than 1 the leading hypothesis can change between steps,
    so the text comes in one chunk when the answer is done."""

    client: AnswerClient = Field(validation_alias=AliasChoices("client", "rag"))
    dials: dict[str, Any] = Field(default_factory=dict)

    @field_validator("client", mode="before")
    @classmethod
    def _client(cls, value: Any) -> AnswerClient:
        return answer_client(value)

    @property
    def _llm_type(self) -> str:
        return "selfrag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"dials": self.dials}

    def _request(
        self, messages: Sequence[BaseMessage], stop: Any, extra: dict[str, Any]
    ) -> AnswerRequest:
        if stop:
            raise ValueError("stop sequences are not supported: segments end the text")
        question, instructions = _question(messages)
        dials = {**self.dials, **extra}
        if instructions and "instructions" not in dials:
            dials["instructions"] = instructions
        return AnswerRequest.of(question, **dials)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return _result(self.client.answer(self._request(messages, stop, kwargs)).response)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        answer = await self.client.aanswer(self._request(messages, stop, kwargs))
        return _result(answer.response)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        config = self.client.config(request)
        events = self.client.stream(request, config)
        text = _TextStream(incremental=config.beam == 1)
        segments = iter(events)
        try:
            for event in segments:
                for chunk in text.event(event):
                    if run_manager is not None:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        finally:  # leaving early cancels the answer: its decode stops at its next step
            segments.close()
        assert events.response is not None  # set once the iteration ends
        yield from text.end(events.response)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        config = await self.client.aconfig(request)
        events = self.client.stream(request, config)
        text = _TextStream(incremental=config.beam == 1)
        segments = aiter(events)
        try:
            async for event in segments:
                for chunk in text.event(event):
                    if run_manager is not None:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        finally:  # an async generator is not closed when dropped: close it now
            await asyncio.shield(segments.aclose())
        assert events.response is not None
        for chunk in text.end(events.response):
            yield chunk


class _TextStream:
    """Turns segment events into text chunks whose concatenation is the answer, then one
    empty chunk carrying the reply's metadata."""

    def __init__(self, incremental: bool) -> None:
        self._incremental = incremental
        self._sent = ""
        self._count = 0

    def event(self, event: SegmentEvent) -> list[ChatGenerationChunk]:
        if not self._incremental or event.index != self._count:
            return []
        self._count += 1
        piece = event.segment.text if self._sent else event.segment.text.lstrip()
        self._sent += piece
        return [_chunk(piece)] if piece else []

    def end(self, response: AnswerResponse) -> list[ChatGenerationChunk]:
        rest = response.answer[len(self._sent) :] if response.answer.startswith(self._sent) else ""
        if not self._sent:
            rest = response.answer
        chunks = [_chunk(rest)] if rest else []
        chunks.append(_chunk("", reply_metadata(response)))
        return chunks


def _chunk(text: str, metadata: dict[str, Any] | None = None) -> ChatGenerationChunk:
    message = AIMessageChunk(content=text, response_metadata=metadata or {})
    return ChatGenerationChunk(message=message)


def _result(response: AnswerResponse) -> ChatResult:
    message = AIMessage(content=response.answer, response_metadata=reply_metadata(response))
    return ChatResult(generations=[ChatGeneration(message=message)])
