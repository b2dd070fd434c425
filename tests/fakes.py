"""Scripted stand-ins for unit tests only: the test sets every probability."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.critique import Branch, LabelProbs
from pipeline.protocols import Generation, Passage


@dataclass
class ScriptedCritic:
    """A critic whose answers are looked up by passage id (None: the no-retrieval branch)."""

    p_retrieve: float = 0.9
    relevance_of: dict[str | None, float] = field(default_factory=dict)
    drafts: dict[str | None, tuple[str, float, str]] = field(default_factory=dict)
    support_of: dict[str | None, dict[str, float]] = field(default_factory=dict)
    utility_of: dict[str | None, dict[str, float]] = field(default_factory=dict)
    name: str = "scripted"
    calls: list[str] = field(default_factory=list)

    @staticmethod
    def _key(b: Branch) -> str | None:
        return b.passage.id if b.passage is not None else None

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        self.calls.append(f"retrieval:{len(branches)}")
        p = self.p_retrieve
        return [LabelProbs({"yes": p, "no": 1 - p}, 10) for _ in branches]

    def relevance(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        self.calls.append(f"relevance:{len(branches)}")
        out = []
        for b in branches:
            r = self.relevance_of.get(self._key(b), 0.5)
            out.append(LabelProbs({"relevant": r, "irrelevant": 1 - r}, 20))
        return out

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        self.calls.append(f"draft:{len(branches)}")
        out = []
        for b in branches:
            text, logprob, finish = self.drafts.get(self._key(b), (" An answer.", -1.0, "eos"))
            n = max(len(text.split()), 1)
            out.append(
                Generation(
                    tokens=list(range(n)),
                    text=text,
                    logprobs=[logprob / n] * n,
                    finish_reason=finish,
                    prefill_tokens=30,  # type: ignore[arg-type]
                )
            )
        return out

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        self.calls.append(f"support:{len(branches)}")
        return [
            LabelProbs(
                self.support_of.get(self._key(b), {"full": 1 / 3, "partial": 1 / 3, "none": 1 / 3}),
                5,
            )
            for b in branches
        ]

    def utility(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        self.calls.append(f"utility:{len(branches)}")
        return [LabelProbs(self.utility_of.get(self._key(b), {"5": 1.0}), 5) for b in branches]


@dataclass
class ListRetriever:
    passages: list[Passage]
    queries: list[str] = field(default_factory=list)

    def search(self, query: str, k: int) -> list[Passage]:
        self.queries.append(query)
        return self.passages[:k]
