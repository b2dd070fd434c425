"""Reflection heads: the softmax(W·h) math, validation, and the heads files on disk."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import pytest

import selfrag.infra.models.heads_store as heads_store
from selfrag.infra.models.heads_store import (
    find_heads,
    heads_path,
    load_heads,
    read_manifest,
    save_heads,
)
from selfrag.pipeline.critics import READ_LAYOUT
from selfrag.pipeline.heads import GROUP_LABELS, GroupHead, HeadsError, ReflectionHeads

SHA = "a" * 64
OTHER_SHA = "b" * 64


def weights(hidden: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {g: rng.normal(size=(len(labels), hidden)) for g, labels in GROUP_LABELS.items()}


def heads_of(w: dict[str, np.ndarray], sha: str = SHA) -> ReflectionHeads:
    groups = {
        g: GroupHead(GROUP_LABELS[g], tuple(tuple(float(v) for v in row) for row in m))
        for g, m in w.items()
    }
    return ReflectionHeads(model_sha256=sha, groups=groups)


# --- head math ----------------------------------------------------------------------------------


def test_group_probabilities_are_the_softmax_of_the_rows_times_the_hidden_state() -> None:
    head = GroupHead(("full", "partial", "none"), ((1.0, 0.0), (0.0, 2.0), (-1.0, 1.0)))
    h = (0.5, -0.25)
    # By hand: z = (0.5, -0.5, -0.75).
    z = [0.5, -0.5, -0.75]
    e = [math.exp(v) for v in z]
    expected = {label: v / sum(e) for label, v in zip(("full", "partial", "none"), e, strict=True)}
    assert head.logits(h) == pytest.approx(z)
    got = head.probabilities(h)
    assert list(got) == ["full", "partial", "none"]
    assert got == pytest.approx(expected)
    assert got["full"] > got["partial"] > got["none"]


def test_probabilities_sum_to_one_even_for_large_logits() -> None:
    for name, head in heads_of(weights(5)).groups.items():
        for h in ([0.0] * 5, [300.0, -200.0, 1.0, 50.0, 7.0], [-1e3] * 5):
            p = head.probabilities(h)
            assert set(p) == set(GROUP_LABELS[name])
            assert sum(p.values()) == pytest.approx(1.0)
            assert all(0.0 <= v <= 1.0 for v in p.values())


def test_a_hidden_state_of_the_wrong_size_is_refused() -> None:
    head = GroupHead(("relevant", "irrelevant"), ((1.0, 2.0, 3.0), (0.0, 0.0, 1.0)))
    with pytest.raises(HeadsError, match="2 values for heads of size 3"):
        head.probabilities((1.0, 2.0))
    with pytest.raises(HeadsError):
        head.logits((1.0, 2.0, 3.0, 4.0))


def test_a_group_head_needs_one_row_per_label_of_one_length() -> None:
    with pytest.raises(HeadsError, match="2 labels but 1 weight rows"):
        GroupHead(("relevant", "irrelevant"), ((1.0, 2.0),))
    with pytest.raises(HeadsError, match="differ in length"):
        GroupHead(("relevant", "irrelevant"), ((1.0, 2.0), (1.0,)))


# --- ReflectionHeads ----------------------------------------------------------------------------


def test_heads_must_cover_every_group() -> None:
    groups = dict(heads_of(weights(3)).groups)
    del groups["utility"]
    with pytest.raises(HeadsError, match="must cover the groups"):
        ReflectionHeads(model_sha256=SHA, groups=groups)


def test_heads_must_carry_each_groups_labels_in_order() -> None:
    groups = dict(heads_of(weights(3)).groups)
    groups["relevance"] = GroupHead(("irrelevant", "relevant"), groups["relevance"].rows)
    with pytest.raises(HeadsError, match="'relevance' has labels"):
        ReflectionHeads(model_sha256=SHA, groups=groups)


def test_groups_must_share_one_hidden_size() -> None:
    groups = dict(heads_of(weights(3)).groups)
    groups["support"] = heads_of(weights(4)).groups["support"]
    with pytest.raises(HeadsError, match="differ in hidden size"):
        ReflectionHeads(model_sha256=SHA, groups=groups)


def test_check_model_refuses_another_model_file_naming_both_hashes() -> None:
    heads = heads_of(weights(3))
    heads.check_model(SHA, 3)
    heads.check_model(SHA, None)
    with pytest.raises(HeadsError) as err:
        heads.check_model(OTHER_SHA, 3)
    message = str(err.value)
    assert SHA in message and OTHER_SHA in message
    assert "selfrag train" in message
    with pytest.raises(HeadsError, match="hidden size 3 for a model of hidden size 8"):
        heads.check_model(SHA, 8)


# --- heads files ----------------------------------------------------------------------------------


def test_save_and_load_round_trip_keeps_float32_rows_and_the_manifest(tmp_path: Path) -> None:
    w = weights(6, seed=1)
    manifest = {"seed": 0, "groups": {"relevance": {"validation_auc": 0.5}}, "model_file": "m"}
    path = heads_path(tmp_path, SHA)
    assert path == tmp_path / "heads" / f"{SHA}.json"
    saved = save_heads(path, SHA, w, manifest)
    loaded = load_heads(path)
    assert loaded == saved
    assert loaded.model_sha256 == SHA
    assert loaded.hidden_size == 6
    for g, labels in GROUP_LABELS.items():
        head = loaded.groups[g]
        assert head.labels == labels
        got = np.asarray(head.rows)
        # Stored as float32: exactly the float32 rounding of the given weights, not the float64.
        np.testing.assert_array_equal(got, w[g].astype(np.float32).astype(np.float64))
        assert not np.array_equal(got, w[g])
        np.testing.assert_array_equal(heads_store.heads_matrix(loaded, g), w[g].astype(np.float32))
    assert read_manifest(path) == {**manifest, "layout": READ_LAYOUT}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_save_refuses_weights_of_the_wrong_shape(tmp_path: Path) -> None:
    w = weights(4)
    w["support"] = w["support"][:2]
    with pytest.raises(HeadsError, match="'support'"):
        save_heads(tmp_path / "h.json", SHA, w, {})
    assert not (tmp_path / "h.json").exists()


def test_a_truncated_heads_file_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = heads_path(tmp_path, SHA)
    save_heads(path, SHA, weights(4), {"seed": 0})
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(HeadsError, match="not a reflection heads file") as err:
        load_heads(path)
    assert str(path) in str(err.value)


def test_a_corrupted_weight_block_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = heads_path(tmp_path, SHA)
    save_heads(path, SHA, weights(4), {})
    doc = json.loads(path.read_text())
    blob = doc["groups"]["relevance"]["float32_base64"]
    doc["groups"]["relevance"]["float32_base64"] = blob[: len(blob) // 2]
    path.write_text(json.dumps(doc))
    with pytest.raises(HeadsError) as err:
        load_heads(path)
    assert str(path) in str(err.value)


def test_a_heads_file_with_wrong_labels_or_format_is_an_error_naming_the_file(
    tmp_path: Path,
) -> None:
    path = heads_path(tmp_path, SHA)
    save_heads(path, SHA, weights(4), {})
    doc = json.loads(path.read_text())
    doc["groups"]["utility"]["labels"] = ["5", "4", "3", "2", "1"]
    path.write_text(json.dumps(doc))
    with pytest.raises(HeadsError, match="'utility' has labels") as err:
        load_heads(path)
    assert str(path) in str(err.value)
    doc["format"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(HeadsError, match="format 99") as err:
        load_heads(path)
    assert str(path) in str(err.value)
    with pytest.raises(HeadsError, match="not a reflection heads file"):
        load_heads(tmp_path / "missing.json")


def test_find_heads_prefers_trained_heads_over_shipped_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(heads_store, "SHIPPED_DIR", shipped)
    home = tmp_path / "home"
    assert find_heads(home, SHA) is None
    save_heads(shipped / f"{SHA}.json", SHA, weights(3), {"from": "shipped"})
    assert find_heads(home, SHA) == shipped / f"{SHA}.json"
    assert find_heads(home, OTHER_SHA) is None
    save_heads(heads_path(home, SHA), SHA, weights(3), {"from": "trained"})
    found = find_heads(home, SHA)
    assert found == home / "heads" / f"{SHA}.json"
    assert read_manifest(found)["from"] == "trained"


def test_heads_of_an_earlier_read_layout_are_passed_over_and_refused_when_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(heads_store, "SHIPPED_DIR", shipped)
    home = tmp_path / "home"
    save_heads(shipped / f"{SHA}.json", SHA, weights(3), {"from": "shipped"})
    trained = save_heads(heads_path(home, SHA), SHA, weights(3), {})
    assert trained.model_sha256 == SHA
    doc = json.loads(heads_path(home, SHA).read_text())
    doc["manifest"]["layout"] = "chat"  # what selfrag wrote before the one-sequence layout
    heads_path(home, SHA).write_text(json.dumps(doc))
    with caplog.at_level("WARNING"):
        assert find_heads(home, SHA) == shipped / f"{SHA}.json"
    assert "earlier selfrag" in caplog.text and "'chat'" in caplog.text
    with pytest.raises(HeadsError, match=r"read positions 'chat'.*selfrag train"):
        load_heads(heads_path(home, SHA))
    (shipped / f"{SHA}.json").unlink()
    assert find_heads(home, SHA) is None


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_heads_with_non_finite_weights_are_refused_naming_the_file(tmp_path: Path, bad) -> None:
    """±inf rows failed at answer time ("-inf + inf in fsum"), all-NaN rows made every
    relevance 0.5: both are refused when the file is read."""
    path = heads_path(tmp_path, SHA)
    save_heads(path, SHA, weights(4), {})
    doc = json.loads(path.read_text())
    rows = np.full((2, 4), bad, dtype=np.float32)
    doc["groups"]["relevance"]["float32_base64"] = base64.b64encode(rows.tobytes()).decode()
    path.write_text(json.dumps(doc))
    with pytest.raises(HeadsError, match="not finite") as err:
        load_heads(path)
    assert str(path) in str(err.value) and "'relevance'" in str(err.value)
    # ... and says what to do about it.
    assert "run `selfrag train` to fit them again" in str(err.value)


def test_a_deeply_nested_heads_file_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = heads_path(tmp_path, SHA)
    path.parent.mkdir(parents=True)
    path.write_text('{"manifest": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(HeadsError, match="nested") as err:
        load_heads(path)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="nested") as err:
        read_manifest(path)
    assert str(path) in str(err.value)
    assert find_heads(tmp_path, SHA) == path  # found, so that loading it says why


def test_heads_of_another_width_are_refused_when_loaded_naming_the_file(tmp_path: Path) -> None:
    """Heads whose `model_sha256` was edited to the model file's passed the hash check and
    failed only at answer time; the width is read from the GGUF header when they load."""
    from selfrag.infra.models.model_files import default_model_path, file_sha256
    from selfrag.infra.settings_loader import load_settings
    from selfrag.runtime.system import LocalRuntime

    model = default_model_path()  # SmolLM2-135M: hidden size 576
    path = heads_path(tmp_path, file_sha256(model))
    save_heads(path, file_sha256(model), weights(896), {})
    rag = LocalRuntime(load_settings(environ={}, overrides={"home": tmp_path}))
    rag.model.__dict__["path"] = model
    with pytest.raises(HeadsError, match="hidden size 896 for a model of hidden size 576") as e:
        _ = rag.model.heads
    assert str(path) in str(e.value)
