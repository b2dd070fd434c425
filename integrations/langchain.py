"""LangChain adapters (install the `langchain` extra): a retriever, a chat model and a runnable,
each over an answer client (`runtime.answer_client.AnswerClient`: a `SelfRAG`'s, taken from
it when given one, in this process or through a server, or the Serve ingress's).

    from selfrag import SelfRAG
    from selfrag.integrations.langchain import SelfRAGChatModel, SelfRAGRetriever

    rag = SelfRAG.open(home="~/rag")
    docs = SelfRAGRetriever(rag=rag, top_k=5).invoke("Who founded Normandy?")
    reply = SelfRAGChatModel(rag=rag).invoke("Who founded Normandy?")
    reply.content, reply.response_metadata["citations"]

The retriever only retrieves: the store's passages ranked by the critique's relevance read
(s_rel), no answer drafted. The chat model answers (`langchain_chat`); `SelfRAGRunnable` gives
the answer with its documents and the full response.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from pydantic import AliasChoices, Field, field_validator

from selfrag.integrations.langchain_chat import SelfRAGChatModel
from selfrag.integrations.sources import HasAnswerClient, answer_client, sources
from selfrag.runtime.answer_client import AnswerClient
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import CritiqueSource
from selfrag.schemas.retrieval import RankedPassage, RetrieveRequest

try:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForRetrieverRun,
        CallbackManagerForRetrieverRun,
    )
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import Runnable, RunnableConfig
    from langchain_core.runnables.utils import AddableDict
except ImportError as exc:  # the extra is not installed
    raise ImportError(
        "selfrag.integrations.langchain needs langchain-core: install selfrag with its "
        "'langchain' extra (pip install '.[langchain]' in the checkout)"
    ) from exc

__all__ = [
    "SelfRAGChatModel",
    "SelfRAGRetriever",
    "SelfRAGRunnable",
    "passage_documents",
    "to_documents",
    "to_output",
]

RunnableInput = str | dict[str, Any]


def to_documents(response: AnswerResponse) -> list[Document]:
    """The answer's passages as Documents, cited ones first (in the order the answer cites
    them), then the rest by retrieval score. `page_content` is the passage text; `metadata`:
    `id`, `title`, `score` (retrieval score), `cited`, `segments` (indices of the segments
    citing it), `s_rel`, `s_sup`, `s_use`, `is_sup` (of the best citing segment, by ranking
    score; None when uncited) and `answer` (the answer's text)."""
    docs = []
    for src in sources(response):
        p = src.passage
        metadata = {
            "id": p.id,
            "title": p.title,
            "score": p.score,
            **src.critique(),
            "answer": response.answer,
        }
        docs.append(Document(id=p.id, page_content=p.text, metadata=metadata))
    return docs


def to_output(response: AnswerResponse) -> dict[str, Any]:
    """`SelfRAGRunnable`'s output: `answer` (text), `documents` (`to_documents`), `response`
    (the full `AnswerResponse`: segments, scores, usage)."""
    return {"answer": response.answer, "documents": to_documents(response), "response": response}


def passage_documents(passages: list[RankedPassage]) -> list[Document]:
    """Ranked passages as Documents, in their order: `page_content` is the passage text;
    `metadata`: `id`, `title`, `url`, `score` (retrieval score) and `s_rel` (relevance)."""
    return [
        Document(
            id=p.id,
            page_content=p.text,
            metadata={
                "id": p.id,
                "title": p.title,
                "url": p.url,
                "score": p.score,
                "s_rel": p.s_rel,
            },
        )
        for p in passages
    ]


class SelfRAGRetriever(BaseRetriever):
    """Retrieves and ranks, no answer drafted: the store's `top_k` passages for the query
    (default: the configured top_k), most relevant first by the critique's s_rel
    (`AnswerClient.retrieve`; `critique` names the source, default the configured one).
    `client` (or `rag`): the `AnswerClient`, or a `SelfRAG` (its `client`)."""

    client: AnswerClient = Field(validation_alias=AliasChoices("client", "rag"))
    top_k: int | None = None
    critique: CritiqueSource | None = None
    collection: str | None = None

    @field_validator("client", mode="before")
    @classmethod
    def _client(cls, value: Any) -> AnswerClient:
        return answer_client(value)

    def _request(self, query: str) -> RetrieveRequest:
        return RetrieveRequest(
            query=query, top_k=self.top_k, critique=self.critique, collection=self.collection
        )

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return passage_documents(self.client.retrieve(self._request(query)))

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        return passage_documents(await self.client.aretrieve(self._request(query)))


class SelfRAGRunnable(Runnable[RunnableInput, dict[str, Any]]):
    """A question in, `{"answer", "documents", "response"}` out (`to_output`); composes with
    `|` like any Runnable. The input is the question, or a dict with `question` (or `input`,
    as in LangChain's retrieval chains) and optionally `dials` overriding the runnable's for
    that call; other keys are ignored.

    `answerer` is an `AnswerClient`, or a `SelfRAG` (its `client` answers). Each call is one
    request to it: `invoke`/`batch` block (batch in threads), `ainvoke`/`abatch` await it.
    `stream`/`astream` yield `{"events": [SegmentEvent]}` per decoded segment (index i
    replaces any segment ≥ i seen before), then one chunk with the output; the chunks add up
    (`AddableDict`) to the output plus `events`."""

    def __init__(self, answerer: AnswerClient | HasAnswerClient, **dials: Any) -> None:
        self.client = answer_client(answerer)
        self.dials = dials

    def _request(self, input: RunnableInput) -> AnswerRequest:
        if isinstance(input, str):
            return AnswerRequest.of(input, **self.dials)
        if isinstance(input, dict):
            question = input.get("question", input.get("input"))
            if isinstance(question, str):
                return AnswerRequest.of(question, **{**self.dials, **input.get("dials", {})})
        raise TypeError(
            f"{type(self).__name__} takes a question: a str, or a dict with a 'question' "
            f"(or 'input') str; got {type(input).__name__}"
        )

    def _invoke(self, input: RunnableInput) -> dict[str, Any]:
        return to_output(self.client.answer(self._request(input)).response)

    async def _ainvoke(self, input: RunnableInput) -> dict[str, Any]:
        return to_output((await self.client.aanswer(self._request(input))).response)

    def invoke(
        self, input: RunnableInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return self._call_with_config(self._invoke, input, config)

    async def ainvoke(
        self, input: RunnableInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return await self._acall_with_config(self._ainvoke, input, config)

    def _stream(self, inputs: Iterator[RunnableInput]) -> Iterator[dict[str, Any]]:
        for input in inputs:
            events = self.client.stream(self._request(input))
            segments = iter(events)
            try:
                for event in segments:
                    yield AddableDict(events=[event])
            finally:  # leaving early cancels the answer: its decode stops at its next step
                segments.close()
            assert events.response is not None  # set once the iteration ends
            yield AddableDict(to_output(events.response))

    async def _astream(self, inputs: AsyncIterator[RunnableInput]) -> AsyncIterator[dict[str, Any]]:
        async for input in inputs:
            events = self.client.stream(self._request(input))
            segments = aiter(events)
            try:
                async for event in segments:
                    yield AddableDict(events=[event])
            finally:  # an async generator is not closed when dropped: close it now
                await segments.aclose()
            assert events.response is not None  # set once the iteration ends
            yield AddableDict(to_output(events.response))

    def stream(
        self, input: RunnableInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[dict[str, Any]]:
        yield from self._transform_stream_with_config(iter([input]), self._stream, config)

    async def astream(
        self, input: RunnableInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        async def one() -> AsyncIterator[RunnableInput]:
            yield input

        chunks = self._atransform_stream_with_config(one(), self._astream, config)
        try:
            async for chunk in chunks:
                yield chunk
        finally:  # closes `_astream`, so leaving early stops the decode
            await chunks.aclose()
