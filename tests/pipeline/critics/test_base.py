"""pipeline/critics/base.py: a group's label probabilities from its tokens' log-probabilities
(several surface forms per label), the engine requests of a read, and Self-RAG's reflection
vocabulary."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from selfrag.pipeline.critics.base import (
    NATIVE_TOKENS,
    RELEVANCE_LABELS,
    RESERVED_PIECES,
    RETRIEVE_LABELS,
    SUPPORT_LABELS,
    UTILITY_LABELS,
    LabelTokens,
    read_groups,
    read_requests,
)
from selfrag.pipeline.prompts import neutralise
from selfrag.pipeline.protocols import TokenScoreRequest, TokenScores

LABELS = LabelTokens({"yes": (11, 12), "no": (21,)})


class ScoringModel:
    """Answers each request with fixed log-probabilities; records the requests."""

    def __init__(self, logprobs: list[float]) -> None:
        self.logprobs = logprobs
        self.requests: list[TokenScoreRequest] = []

    def next_token_logprobs(self, requests: Sequence[TokenScoreRequest]) -> list[TokenScores]:
        self.requests += requests
        return [TokenScores(list(self.logprobs), prefill_tokens=len(r.prompt)) for r in requests]


def test_a_labels_mass_sums_its_surface_forms_and_an_impossible_token_adds_nothing():
    assert LABELS.candidates == [11, 12, 21]
    probs = LABELS.probabilities([math.log(0.2), math.log(0.1), -math.inf])
    assert probs == {"yes": pytest.approx(0.3), "no": 0.0}


def test_read_groups_asks_for_every_labels_tokens_after_each_prompt():
    model = ScoringModel([math.log(0.5), math.log(0.25), math.log(0.125)])
    prompts = [[1, 2, 3], [4, 5]]
    reads = read_groups(model, prompts, LABELS, reusable=[2, 0], hidden_state=True)  # type: ignore[arg-type]
    assert [r.probs for r in reads] == [pytest.approx({"yes": 0.75, "no": 0.125})] * 2
    assert [r.prefill_tokens for r in reads] == [3, 2]
    assert [(list(q.prompt), list(q.candidates), q.reusable_prefix) for q in model.requests] == [
        ([1, 2, 3], [11, 12, 21], 2),
        ([4, 5], [11, 12, 21], 0),
    ]
    assert all(q.hidden_state for q in model.requests)


def test_read_groups_of_no_prompt_calls_no_engine():
    model = ScoringModel([])
    assert read_groups(model, [], LABELS) == []  # type: ignore[arg-type]
    assert model.requests == []


def test_a_learned_read_asks_for_no_candidate_and_the_layers_named():
    [request] = read_requests([[1, 2]], [1], hidden=True, layers=[3, 5])
    assert (tuple(request.candidates), request.reusable_prefix) == ((), 1)
    assert request.hidden_state and request.hidden_layers == (3, 5)
    assert read_requests([[1]], [0], hidden=False)[0].hidden_layers == ()


def test_the_native_vocabulary_has_one_token_per_label_of_each_group():
    groups = {
        "retrieve": RETRIEVE_LABELS,
        "relevance": RELEVANCE_LABELS,
        "support": SUPPORT_LABELS,
        "utility": UTILITY_LABELS,
    }
    assert {name: tuple(tokens) for name, tokens in NATIVE_TOKENS.items()} == groups
    pieces = [t for tokens in NATIVE_TOKENS.values() for t in tokens.values()]
    assert sorted(RESERVED_PIECES) == sorted(pieces) and len(set(pieces)) == len(pieces)


def test_untrusted_text_spells_no_reserved_piece():
    text = " ".join(RESERVED_PIECES)
    defused = neutralise(text, RESERVED_PIECES)
    assert not any(piece in defused for piece in RESERVED_PIECES)
