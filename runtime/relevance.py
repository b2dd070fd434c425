"""Retrieval without drafting: the store's top passages for a query, ranked by the critique's
relevance read (what the decoder's first step reads before it drafts), or in the store's own
order."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from selfrag.pipeline.critics import Branch, LabelProbs
from selfrag.pipeline.protocols import COLLECTION, Passage, PassageSearch
from selfrag.pipeline.scoring import relevance_score
from selfrag.schemas.retrieval import RankedPassage

Relevance = Callable[[Sequence[Branch]], list[LabelProbs]]
"""A critic's `relevance` read: the IsRel probabilities of each branch."""


def ranked_passages(
    query: str, search: PassageSearch, top_k: int, relevance: Relevance | None
) -> list[RankedPassage]:
    """The `top_k` passages `search` finds for `query`: most relevant first by s_rel
    (`relevance`'s read; ties keep the store's order), or with `relevance` None in the store's
    order, nothing read."""
    passages = search.search(query, top_k)
    if relevance is None:
        return [RankedPassage.model_validate(p.shown()) for p in passages]
    reads = relevance([Branch(query, "", p) for p in passages]) if passages else []
    scored = [(relevance_score(r.probs), p) for r, p in zip(reads, passages, strict=True)]
    scored.sort(key=lambda pair: pair[0], reverse=True)
    return [_ranked(p, s_rel) for s_rel, p in scored]


def as_passage(p: RankedPassage) -> Passage:
    """A retrieved passage as the pipeline holds it (what a prompt shows of it: id, title,
    text, scores, URL and corpus)."""
    metadata = {"url": p.url} if p.url else {}
    if p.corpus:
        metadata[COLLECTION] = p.corpus
    return Passage(p.id, p.text, p.title, p.score, metadata, p.similarity)


def _ranked(p: Passage, s_rel: float) -> RankedPassage:
    return RankedPassage.model_validate(p.shown() | {"s_rel": min(max(s_rel, 0.0), 1.0)})
