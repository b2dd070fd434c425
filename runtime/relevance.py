"""Retrieval without drafting: the store's top passages for a query, ranked by the critique's
relevance read (what the decoder's first step reads before it drafts)."""

from __future__ import annotations

from selfrag.pipeline.critics import Branch, Critic
from selfrag.pipeline.protocols import Passage, PassageSearch
from selfrag.pipeline.scoring import relevance_score
from selfrag.schemas.retrieval import RankedPassage


def ranked_passages(
    query: str, search: PassageSearch, critic: Critic, top_k: int
) -> list[RankedPassage]:
    """The `top_k` passages `search` finds for `query`, most relevant first by s_rel (ties
    keep the store's order)."""
    passages = search.search(query, top_k)
    reads = critic.relevance([Branch(query, "", p) for p in passages]) if passages else []
    scored = [(relevance_score(r.probs), p) for r, p in zip(reads, passages, strict=True)]
    scored.sort(key=lambda pair: pair[0], reverse=True)
    return [_ranked(p, s_rel) for s_rel, p in scored]


def _ranked(p: Passage, s_rel: float) -> RankedPassage:
    return RankedPassage.model_validate(p.shown() | {"s_rel": min(max(s_rel, 0.0), 1.0)})
