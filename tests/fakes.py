"""Scripted stand-ins for unit tests only: the test sets every probability."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from selfrag.pipeline.critics import Branch, LabelProbs
from selfrag.pipeline.protocols import Generation, Passage
from selfrag.schemas.calibration import SupportCalibration


def echo_or_loop(
    branches: Sequence[Branch], drafts: Sequence[Generation], *, loop_on: str, echo_on: str
) -> list[Generation]:
    """`drafts` as a small model writes some: a loop for the branches whose passage id starts
    with `loop_on`, and the question echoed back, labelled, for those starting with `echo_on`
    until the answer so far holds the echo."""
    out = []
    for b, g in zip(branches, drafts, strict=True):
        assert b.passage is not None
        if b.passage.id.startswith(loop_on):
            g = replace(g, text="The answer is: " * 6)
        elif b.passage.id.startswith(echo_on) and not b.prefix:
            g = replace(g, text=f"Question: {b.question}")
        out.append(g)
    return out


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
    drafted_branches: list[Branch] = field(default_factory=list)
    draft_budgets: list[int] = field(default_factory=list)
    """The `max_tokens` of each draft call."""

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
        self.drafted_branches.extend(branches)
        self.draft_budgets.append(max_tokens)
        out = []
        for b in branches:
            text, logprob, finish = self.drafts.get(self._key(b), (" An answer.", -1.0, "eos"))
            if len(text.split()) > max_tokens:
                text, finish = " ".join(text.split()[:max_tokens]), "length"
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

    def search_many(self, queries, k):  # type: ignore[no-untyped-def]
        return [self.search(q, k) for q in queries]


class WordModel:
    """A toy `LanguageModel`: one token per word or special piece, scripted next-token logprobs.

    `script(prompt_text, candidate_pieces)` returns a dict piece -> probability; unlisted
    candidates get probability 0 (logprob -inf).
    """

    def __init__(
        self, specials=(), script=None, template=None, draft_text=" It is so.", hidden=None
    ):
        """`hidden(prompt_text)`, when given, is the scripted hidden state of a prompt."""
        import re

        self._re = re
        self.specials = list(specials)
        self.vocab: dict[str, int] = {}
        self.pieces: list[str] = []
        for piece in self.specials:
            self._id(piece)
        self.script = script or (lambda prompt, pieces: {})
        self.template = template
        self.draft_text = draft_text
        self.hidden = hidden
        self.prompts: list[str] = []

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.vocab[piece]

    @property
    def model_id(self) -> str:
        return "word-model"

    @property
    def chat_template(self):
        return self.template

    @property
    def hidden_size(self):
        return None if self.hidden is None else len(self.hidden(""))

    @property
    def n_layers(self):
        return None  # no middle layers to read

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        if special and self.specials:
            pattern = "(" + "|".join(self._re.escape(s) for s in self.specials) + ")"
            parts = self._re.split(pattern, text)
        else:
            parts = [text]
        ids: list[int] = []
        for part in parts:
            if special and part in self.specials:
                ids.append(self.vocab[part])
            else:
                # Plain text never yields a special id: a word equal to a special piece gets
                # its own "text" entry.
                ids.extend(self._id("txt:" + w) for w in self._re.findall(r"\s*\S+|\s+", part))
        return ids

    def detokenize(self, tokens) -> str:
        return "".join(self.pieces[t].removeprefix("txt:") for t in tokens)

    def special_token_id(self, piece: str):
        return self.vocab.get(piece) if piece in self.specials else None

    def bos_tokens(self) -> list[int]:
        return []

    def next_token_logprobs(self, requests):
        import math

        from selfrag.pipeline.protocols import TokenScores

        out = []
        for r in requests:
            text = self.detokenize(r.prompt)
            self.prompts.append(text)
            pieces = [self.pieces[c].removeprefix("txt:") for c in r.candidates]
            probs = self.script(text, pieces)
            hidden = None
            if r.hidden_state:
                assert self.hidden is not None, "this WordModel has no hidden states"
                hidden = tuple(self.hidden(text))
            out.append(
                TokenScores(
                    [math.log(probs[p]) if probs.get(p, 0) > 0 else -math.inf for p in pieces],
                    len(r.prompt),
                    hidden,
                )
            )
        return out

    def generate(self, requests):
        from selfrag.pipeline.protocols import Generation

        out = []
        for r in requests:
            self.prompts.append(self.detokenize(r.prompt))
            ids = self.tokenize(self.draft_text)
            out.append(Generation(ids, self.draft_text, [-0.5] * len(ids), "eos", len(r.prompt)))
        return out

    def continuation_logprobs(self, requests):
        raise NotImplementedError


class HashEmbedder:
    """Unit vectors from a hash of the text: enough to store and read passages back (the
    store's tests; a child process's script carries its own copy, as it runs standalone)."""

    dim = 8
    model_id = "hash-embedder"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        rows = []
        for text in texts:
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
            row = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
            rows.append(row / np.linalg.norm(row))
        return np.array(rows, dtype=np.float32).reshape(len(texts), 8)


def support_calibration(
    sha: str = "a" * 64, critique: str = "learned", **fields: Any
) -> SupportCalibration:
    """A support calibration as `selfrag calibrate` writes one (threshold 0.52), `fields`
    changed."""
    values: dict[str, Any] = dict(
        model_sha256=sha,
        model_file="m.gguf",
        critique=critique,
        fingerprint="model-fp",
        min_support_score=0.52,
        max_answerable_abstain=0.15,
        answerable_abstain=0.15,
        unanswerable_abstain=0.4,
        auroc=0.7,
        questions=40,
        answerable={"n": 40},
        unanswerable={"n": 38},
        pruned={"answerable": 1, "unanswerable": 5},
        style="wh",
        seed=0,
        index_version="v1",
        passages=1000,
        seconds=100.0,
        created="2026-12-03T00:00:00+00:00",
    )
    values.update(fields)
    return SupportCalibration(**values)
