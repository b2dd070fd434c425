"""BM25 sparse vectors: deterministic tokens, indices and term-frequency weights."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from selfrag.infra.sparse import (
    AVERAGE_LENGTH,
    K1,
    document_vector,
    query_vector,
    token_index,
    tokenize,
)


def test_tokenize_lowercases_drops_stop_words_and_possessives() -> None:
    text = "The Normans' castle, Normandy’s DUKE and 1066 snake_case"
    assert tokenize(text) == ["normans", "castle", "normandy", "duke", "1066", "snake", "case"]
    assert tokenize("the and of to") == []
    assert tokenize("Éire café") == ["éire", "café"]


def test_token_index_is_pinned_and_in_range() -> None:
    # Pinned values: changing them silently breaks every stored index (bump sparse.SCHEME).
    assert token_index("normans") == 1580975701
    assert token_index("normandy") == 1190432539
    assert all(0 <= token_index(t) < 2**31 for t in ["", "a", "x" * 1000, "日本"])


def test_token_index_does_not_depend_on_the_hash_seed() -> None:
    code = "from selfrag.infra.sparse import token_index; print(token_index('normans'))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {str(token_index("normans"))}


def test_document_vector_is_sorted_unique_and_saturates() -> None:
    vector = document_vector("normans normans normans normandy castle")
    assert vector.indices == sorted(set(vector.indices))
    assert len(vector) == 3
    weights = dict(zip(vector.indices, vector.values, strict=True))
    # More occurrences weigh more, but never beyond k1 + 1.
    assert weights[token_index("normans")] > weights[token_index("normandy")]
    assert weights[token_index("normans")] < K1 + 1


def test_document_vector_normalises_by_length() -> None:
    short = document_vector("normans castle")
    long = document_vector("normans " + " ".join(f"filler{i}" for i in range(200)))
    index = token_index("normans")
    short_weight = dict(zip(short.indices, short.values, strict=True))[index]
    long_weight = dict(zip(long.indices, long.values, strict=True))[index]
    assert long_weight < short_weight


def test_document_vector_matches_the_bm25_formula_at_average_length() -> None:
    # At exactly the average length the length factor is 1: weight = tf*(k1+1)/(tf+k1).
    tokens = ["alpha"] * 2 + [f"t{i}" for i in range(int(AVERAGE_LENGTH) - 2)]
    vector = document_vector(" ".join(tokens))
    weight = dict(zip(vector.indices, vector.values, strict=True))[token_index("alpha")]
    assert weight == pytest.approx(2 * (K1 + 1) / (2 + K1))


def test_query_vector_is_one_per_distinct_term() -> None:
    vector = query_vector("Who were the Normans, the NORMANS?")
    assert vector.indices == [token_index("normans")]
    assert vector.values == [1.0]
    assert len(query_vector("who is the")) == 0
    assert query_vector("castle duke") == query_vector("duke castle")
