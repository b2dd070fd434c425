"""jobs/answerability_training.py without a model: the blocks collected for a model's depth,
the default features, the feature table's file round trip (old files included), and a
one-label table refused before fitting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from selfrag.jobs.answerability_training import (
    AnswerabilityFitError,
    candidate_blocks,
    default_features,
    fit_model,
    load_table,
    save_table,
)
from selfrag.pipeline.answerability_model import FeatureTable, probe_name


def test_the_blocks_collected_follow_the_models_depth_and_end_with_the_last():
    # SmolLM2's 30 layers: layers 6, 9, 12, 15, 19, 22, 26 counted from 1, and the last.
    assert candidate_blocks(30) == [5, 8, 11, 14, 18, 21, 25, 29]
    for n_layers in (2, 3, 12, 24, 64):
        blocks = candidate_blocks(n_layers)
        assert blocks == sorted(set(blocks))
        assert blocks[-1] == n_layers - 1 and blocks[0] >= 0


def test_the_default_features_are_s_rel_and_the_middle_blocks_relevance_probe():
    assert default_features(30) == ("s_rel", probe_name(14, "relevance"))


def _table() -> FeatureTable:
    return FeatureTable(
        {"s_rel": np.array([0.9, 0.2, 0.6]), "s_sup": np.array([0.8, 0.1, 0.5])},
        {probe_name(14, "relevance"): np.ones((3, 4), dtype=np.float32)},
        np.array([1.0, 0.0, 1.0]),
        ["q1", "q2", "q2"],
    )


def test_a_table_and_how_it_was_collected_come_back_from_its_file(tmp_path: Path):
    path = tmp_path / "deep" / "features.npz"
    meta = {"source": "learned", "n_layers": 30, "blocks": [14]}
    save_table(path, _table(), meta)
    table, read_meta = load_table(path)
    assert read_meta == meta
    assert table.groups == ["q1", "q2", "q2"]
    np.testing.assert_array_equal(table.labels, [1.0, 0.0, 1.0])
    assert set(table.values) == {"s_rel", "s_sup"}
    np.testing.assert_array_equal(table.values["s_rel"], [0.9, 0.2, 0.6])
    assert set(table.states) == {probe_name(14, "relevance")}
    assert table.states[probe_name(14, "relevance")].dtype == np.float32


def test_an_older_file_keyed_by_block_number_reads_as_support_probes(tmp_path: Path):
    path = tmp_path / "old.npz"
    np.savez_compressed(
        path,
        labels=np.array([1.0, 0.0]),
        groups=np.asarray(["a", "b"]),
        meta=np.asarray('{"n_layers": 30}'),
        value_s_rel=np.array([0.5, 0.4]),
        state_14=np.zeros((2, 4), dtype=np.float32),
    )
    table, meta = load_table(path)
    assert set(table.states) == {probe_name(14)} and meta == {"n_layers": 30}


def test_a_table_with_one_label_only_is_refused():
    table = _table()
    one_label = FeatureTable(table.values, table.states, np.ones(3), table.groups)
    with pytest.raises(AnswerabilityFitError, match="one label only"):
        fit_model(one_label, {"n_layers": 30}, "sha")
