"""infra/models/critic_label_cache.py: a critic's reads on disk, one file per fingerprint."""

from __future__ import annotations

from pathlib import Path

from selfrag.infra.models.critic_label_cache import CriticLabelFile, critic_cache_path


def test_values_survive_a_reload_and_a_cut_line_is_skipped(tmp_path: Path):
    path = critic_cache_path(tmp_path, "qwen sha256:ab verify:12")
    assert path.parent == tmp_path / "critic_labels" and path.suffix == ".jsonl"
    assert path != critic_cache_path(tmp_path, "qwen sha256:cd verify:12")
    cache = CriticLabelFile(path)
    assert len(cache) == 0 and cache.get("a") is None
    cache.put({"a": 0.25, "b": 0.75})
    cache.put({})
    with path.open("a") as f:
        f.write('{"key": "c", "s_sup": 0.5}\n{"key": "d", "s_')  # an interrupted append
        f.write('\n[1]\n{"key": "e", "s_sup": NaN}\n')
    again = CriticLabelFile(path)
    assert len(again) == 3
    assert (again.get("a"), again.get("b"), again.get("c"), again.get("d")) == (
        0.25,
        0.75,
        0.5,
        None,
    )


def test_reads_put_after_an_interrupted_append_survive_a_reload(tmp_path: Path):
    path = critic_cache_path(tmp_path, "qwen sha256:ab verify:12")
    CriticLabelFile(path).put({"a": 0.25})
    with path.open("a") as f:
        f.write('{"key": "b", "s_')  # the run was killed here
    CriticLabelFile(path).put({"c": 0.5})
    again = CriticLabelFile(path)
    assert (again.get("a"), again.get("b"), again.get("c")) == (0.25, None, 0.5)
