"""Training the reflection heads: the count checks and the feature reads."""

from __future__ import annotations

import re

import numpy as np
import pytest

from selfrag.jobs.training import (
    MIN_EXAMPLES,
    MIN_PER_LABEL,
    TrainingError,
    check_counts,
    hidden_features,
)
from selfrag.pipeline.critics import Branch, ChatCritic
from selfrag.pipeline.learning.reflection_data import Example
from selfrag.pipeline.protocols import Passage
from tests.fakes import WordModel
from tests.jobs.test_head_fitting import ENOUGH, synthetic_examples


def test_check_counts_accepts_enough_examples() -> None:
    examples, _ = synthetic_examples(np.random.default_rng(5), ENOUGH)
    counts = check_counts(examples)
    assert {g: dict(c) for g, c in counts.items()} == ENOUGH


def test_check_counts_names_a_group_with_too_few_examples_and_its_count() -> None:
    few = {**ENOUGH, "relevance": {"relevant": 6, "irrelevant": 6}}
    assert 12 < MIN_EXAMPLES
    examples, _ = synthetic_examples(np.random.default_rng(6), few)
    with pytest.raises(TrainingError) as err:
        check_counts(examples)
    message = str(err.value)
    assert "'relevance'" in message and "12 examples" in message
    assert "relevant 6, irrelevant 6" in message
    assert not any(f"'{g}'" in message for g in ("retrieve", "support", "utility"))


def test_check_counts_names_a_contrasted_label_with_too_few_examples() -> None:
    lopsided = {**ENOUGH, "utility": {"5": 40, "1": MIN_PER_LABEL - 1}}
    examples, _ = synthetic_examples(np.random.default_rng(7), lopsided)
    with pytest.raises(TrainingError, match=r"'utility'.*44 examples.*1 4,") as err:
        check_counts(examples)
    assert f"at least {MIN_PER_LABEL} each of 5 and 1" in str(err.value)


def test_check_counts_names_a_group_with_no_examples() -> None:
    examples, _ = synthetic_examples(
        np.random.default_rng(8), {g: c for g, c in ENOUGH.items() if g != "support"}
    )
    with pytest.raises(TrainingError, match="'support' head: it got 0 examples"):
        check_counts(examples)


# --- hidden features ----------------------------------------------------------------------------


def marker_hidden(text: str) -> list[float]:
    """A hidden state that names the example its prompt belongs to ("item<N>")."""
    m = re.search(r"item(\d+)", text)
    return [float(m.group(1)) if m else -1.0, float("Passage:" in text), float(len(text)), 1.0]


def test_hidden_features_keep_the_examples_order_although_requests_are_sorted() -> None:
    model = WordModel(hidden=marker_hidden, draft_text=" An answer.")
    critic = ChatCritic(model)
    zeta = Passage("z", "Zeta passage text about rivers and seas.", "Zeta")
    alpha = Passage("a", "Alpha passage text about mountains.", "Alpha")
    examples = [
        Example("relevance", "relevant", Branch("item0 which river?", "", zeta), key="z"),
        Example("retrieve", "yes", Branch("item1 which sea?", "", None), key="q1"),
        Example("support", "full", Branch("item2 which peak?", "", alpha), "Everest.", key="a"),
        Example("utility", "5", Branch("item3 which peak?", "", alpha), "Everest.", key="a"),
        Example("relevance", "irrelevant", Branch("item4 which river?", "", alpha), key="z"),
        Example("retrieve", "no", Branch("item5 which sea?", "The North Sea.", None), key="q1"),
        Example("support", "none", Branch("item6 which river?", "", zeta), "The Nile.", key="z"),
    ]
    X = hidden_features(model, critic, examples, batch=2, progress=False)
    assert X.shape == (len(examples), 4) and X.dtype == np.float32
    np.testing.assert_array_equal(X[:, 0], np.arange(len(examples), dtype=np.float32))
    # Only the prompts with a passage in view (relevance, support) show it; utility does not.
    np.testing.assert_array_equal(X[:, 1], [1, 0, 1, 0, 1, 0, 1])
    # The engine saw the prompts grouped by their reusable prefix, not in the examples' order.
    seen = [int(m.group(1)) for p in model.prompts if (m := re.search(r"item(\d+)", p))]
    assert sorted(seen) == list(range(len(examples)))
    assert seen != list(range(len(examples)))
    # Each row is the state after that example's own prompt (its length, too).
    for i, text in zip(seen, model.prompts, strict=True):
        assert X[i, 2] == len(text)
    assert "The North Sea." in model.prompts[seen.index(5)]
