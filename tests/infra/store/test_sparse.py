"""BM25 sparse vectors (Qdrant's BM25): deterministic, English stop words and stemming,
term-frequency weights that saturate and normalise by length."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from selfrag.infra.store.sparse import AVERAGE_LENGTH, K1, SCHEME, B, document_vector, query_vector


def _weight(text: str, term: str) -> float:
    [index] = query_vector(term).indices
    vector = document_vector(text)
    return dict(zip(vector.indices, vector.values, strict=True))[index]


def test_stop_words_drop_and_inflections_stem_to_one_term() -> None:
    assert query_vector("the and of to").indices == []
    assert document_vector("what is the").indices == []
    assert query_vector("Normans").indices == query_vector("normans").indices
    assert query_vector("castle castles").indices == query_vector("castle").indices


def test_vectors_do_not_depend_on_the_process() -> None:
    code = (
        "from selfrag.infra.store.sparse import query_vector; "
        "print(query_vector('normans').indices)"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {str(query_vector("normans").indices)}


def test_document_vector_is_sorted_unique_and_saturates() -> None:
    vector = document_vector("normans normans normans normandy castle")
    assert vector.indices == sorted(set(vector.indices))
    assert len(vector.indices) == 3
    # More occurrences weigh more, but never beyond k1 + 1.
    heavy = _weight("normans normans normans normandy castle", "normans")
    light = _weight("normans normans normans normandy castle", "normandy")
    assert light < heavy < K1 + 1


def test_document_vector_normalises_by_length() -> None:
    short = _weight("normans castle", "normans")
    long = _weight("normans " + " ".join(f"filler{i}" for i in range(200)), "normans")
    assert long < short


def test_document_vector_matches_the_bm25_formula_at_average_length() -> None:
    # At exactly the average length the length factor is 1: weight = tf*(k1+1)/(tf+k1).
    tokens = ["alpha"] * 2 + [f"t{i}x" for i in range(int(AVERAGE_LENGTH) - 2)]
    assert _weight(" ".join(tokens), "alpha") == pytest.approx(2 * (K1 + 1) / (2 + K1), rel=1e-4)


def test_query_vector_is_one_per_distinct_term() -> None:
    vector = query_vector("Who were the Normans, the NORMANS?")
    assert vector.indices == query_vector("normans").indices
    assert vector.values == [1.0]


def test_the_scheme_names_every_parameter() -> None:
    assert f"k={K1}" in SCHEME and f"b={B}" in SCHEME and f"avg_len={AVERAGE_LENGTH:g}" in SCHEME
