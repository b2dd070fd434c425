"""What the framework adapters share: the answer client they talk to (`answer_client`), and an
answer's passages as sources, cited first, each with the scores of the segment that cites it.
No framework here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from selfrag.runtime.answer_client import AnswerClient
from selfrag.schemas.answer import AnswerResponse, PassageOut, SegmentOut


class HasAnswerClient(Protocol):
    """What holds an answer client: `selfrag.SelfRAG` (its `client`)."""

    @property
    def client(self) -> AnswerClient: ...


def answer_client(source: AnswerClient | HasAnswerClient) -> AnswerClient:
    """The answer client an adapter talks to: `source` itself when it is one (in this process,
    `runtime.answer_client.LocalAnswerClient`; through Serve,
    `actors.http.service.ServeAnswerService`; over HTTP, `runtime.http_client.HTTPAnswerClient`),
    else its `client` (a `selfrag.SelfRAG`'s, in process or `SelfRAG.open(url=...)`)."""
    if isinstance(source, AnswerClient):
        return source
    client = getattr(source, "client", None)
    if isinstance(client, AnswerClient):
        return client
    raise TypeError(
        "an adapter answers with an answer client (runtime.answer_client.AnswerClient) or a "
        f"selfrag.SelfRAG, not {type(source).__name__}"
    )


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
