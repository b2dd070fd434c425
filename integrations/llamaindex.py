"""LlamaIndex adapter (the `llamaindex` extra): a query engine over an answer client
(`runtime.answer_client.AnswerClient`, or a `selfrag.SelfRAG`'s).

    from selfrag import SelfRAG
    from selfrag.integrations.llamaindex import SelfRAGQueryEngine

    engine = SelfRAGQueryEngine(answerer=SelfRAG.open(home="~/rag"), dials={"top_k": 3})
    r = engine.query("Who founded Normandy?")
    r.response, [(n.node_id, n.score) for n in r.source_nodes], r.metadata["abstained"]

Needs no LLM, embedding model or download from LlamaIndex: SelfRAG retrieves and generates;
LlamaIndex's `Settings` are never read.
"""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, Field, field_validator

from selfrag.integrations.sources import answer_client, sources
from selfrag.runtime.answer_client import AnswerClient
from selfrag.schemas.answer import AnswerRequest, AnswerResponse

try:
    from llama_index.core.base.response.schema import Response
    from llama_index.core.query_engine import CustomQueryEngine
    from llama_index.core.schema import NodeWithScore, TextNode
except ImportError as exc:  # the extra is not installed
    raise ImportError(
        "selfrag.integrations.llamaindex needs llama-index-core: install selfrag with its "
        "'llamaindex' extra (pip install '.[llamaindex]' in the checkout)"
    ) from exc

__all__ = ["SelfRAGQueryEngine", "to_nodes", "to_response"]

# Scores and flags stay out of the text an LLM or an embedder sees of a node; the title stays.
_SCORE_KEYS = ["retrieval_score", "cited", "segments", "s_rel", "s_sup", "s_use", "is_sup"]


def to_nodes(response: AnswerResponse) -> list[NodeWithScore]:
    """The answer's passages as nodes, cited ones first (in the order the answer cites them),
    then the rest by retrieval score. `score` is the relevance score s_rel of the best citing
    segment (by ranking score), None for a passage no segment cites (its retrieval score is in
    the metadata: the two are on different scales). Node metadata: `title`, `retrieval_score`,
    `cited`, `segments` (indices of the citing segments), and `s_rel`, `s_sup`, `s_use`,
    `is_sup` of the best citing segment (None when uncited)."""
    nodes = []
    for src in sources(response):
        p, seg = src.passage, src.segment
        metadata = {"title": p.title, "retrieval_score": p.score, **src.critique()}
        node = TextNode(
            id_=p.id,
            text=p.text,
            metadata=metadata,
            excluded_llm_metadata_keys=list(_SCORE_KEYS),
            excluded_embed_metadata_keys=list(_SCORE_KEYS),
        )
        nodes.append(NodeWithScore(node=node, score=seg.s_rel if seg else None))
    return nodes


def to_response(response: AnswerResponse) -> Response:
    """A LlamaIndex `Response`: `response` is the answer text, `source_nodes` `to_nodes`,
    `metadata` has `question`, `abstained`, `segments` (each segment's text, citation and
    scores), `critique`, `usage`, `timings_ms` and `model_id`."""
    metadata = {
        "question": response.question,
        "abstained": response.abstained,
        "segments": [s.model_dump() for s in response.segments],
        "critique": response.critique,
        "usage": response.usage.model_dump(),
        "timings_ms": dict(response.timings_ms),
        "model_id": response.model_id,
    }
    return Response(response=response.answer, source_nodes=to_nodes(response), metadata=metadata)


class SelfRAGQueryEngine(CustomQueryEngine):
    """`query` (blocking) and `aquery` (awaited) answer with `client` (or `answerer`: an
    `AnswerClient`, or a `SelfRAG`, whose `client` answers) and return `to_response`'s
    Response. `dials` go to every answer (e.g. `{"top_k": 3, "mode": "always"}`)."""

    client: AnswerClient = Field(validation_alias=AliasChoices("client", "answerer"))
    dials: dict[str, Any] = Field(default_factory=dict)

    @field_validator("client", mode="before")
    @classmethod
    def _client(cls, value: Any) -> AnswerClient:
        return answer_client(value)

    def custom_query(self, query_str: str) -> Response:
        request = AnswerRequest.of(query_str, **self.dials)
        return to_response(self.client.answer(request).response)

    async def acustom_query(self, query_str: str) -> Response:
        answer = await self.client.aanswer(AnswerRequest.of(query_str, **self.dials))
        return to_response(answer.response)
