"""What the framework adapters share: the `Answerer` they wrap and an answer's passages as
sources, cited first, each with the scores of the segment that cites it. No framework here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from selfrag.schemas.answer import AnswerResponse, PassageOut, SegmentOut
from selfrag.schemas.retrieval import RankedPassage

if TYPE_CHECKING:  # loading the API loads the engine and store adapters: only when used
    from selfrag.api import SegmentStream


@runtime_checkable
class Answerer(Protocol):
    """What the adapters call: `selfrag.SelfRAG`, or anything answering the same way.
    `dials` are `DecodingConfig` fields (and `max_tokens`)."""

    def answer(self, question: str, **dials: Any) -> AnswerResponse: ...

    async def aanswer(self, question: str, **dials: Any) -> AnswerResponse: ...


@runtime_checkable
class StreamingAnswerer(Answerer, Protocol):
    """An `Answerer` that also streams segments, as `selfrag.SelfRAG` does."""

    def stream(self, question: str, **dials: Any) -> SegmentStream: ...

    def astream(self, question: str, **dials: Any) -> SegmentStream: ...


@runtime_checkable
class Retrieving(Protocol):
    """What a retriever adapter calls: `selfrag.SelfRAG`'s retrieval without drafting."""

    def retrieve(
        self, query: str, *, top_k: int | None = None, critique: str | None = None
    ) -> list[RankedPassage]: ...

    async def aretrieve(
        self, query: str, *, top_k: int | None = None, critique: str | None = None
    ) -> list[RankedPassage]: ...


@dataclass(frozen=True)
class Source:
    """One retrieved passage of an answer. `segment` is the best segment citing it (highest
    ranking score S), None when no segment does; `segments` are the indices of all that do."""

    passage: PassageOut
    segment: SegmentOut | None
    segments: tuple[int, ...]

    @property
    def cited(self) -> bool:
        return self.segment is not None

    def critique(self) -> dict[str, Any]:
        """`cited`, `segments` and the citing segment's `s_rel`, `s_sup`, `s_use`, `is_sup`
        (None when uncited): the metadata every adapter attaches."""
        seg = self.segment
        return {
            "cited": self.cited,
            "segments": list(self.segments),
            "s_rel": seg.s_rel if seg else None,
            "s_sup": seg.s_sup if seg else None,
            "s_use": seg.s_use if seg else None,
            "is_sup": seg.is_sup if seg else None,
        }


def sources(response: AnswerResponse) -> list[Source]:
    """The answer's passages, each once: the cited ones in the order the answer first cites
    them, then the others in the response's order (retrieval score, highest first)."""
    passages: dict[str, PassageOut] = {}
    for p in response.passages:
        passages.setdefault(p.id, p)
    citing: dict[str, list[int]] = {}
    for i, s in enumerate(response.segments):
        if s.citation is not None and s.citation.passage_id in passages:
            citing.setdefault(s.citation.passage_id, []).append(i)
    out = []
    for pid, indices in citing.items():
        best = max(indices, key=lambda i: response.segments[i].score)
        out.append(Source(passages[pid], response.segments[best], tuple(indices)))
    out.extend(Source(p, None, ()) for pid, p in passages.items() if pid not in citing)
    return out
