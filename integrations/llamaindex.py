"""LlamaIndex adapter (the `llamaindex` extra): a query engine over
`selfrag.SelfRAG`.

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

from pydantic import Field

from selfrag.integrations.sources import Answerer, sources
from selfrag.schemas.answer import AnswerResponse

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
    """`query`/`aquery` answer with `answer`/`aanswer` and return `to_response`'s Response.
    `dials` go to every answer (e.g. `{"top_k": 3, "mode": "always"}`)."""

    answerer: Answerer
    dials: dict[str, Any] = Field(default_factory=dict)

    def custom_query(self, query_str: str) -> Response:
        return to_response(self.answerer.answer(query_str, **self.dials))

    async def acustom_query(self, query_str: str) -> Response:
        return to_response(await self.answerer.aanswer(query_str, **self.dials))
