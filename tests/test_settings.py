from pathlib import Path

import pytest

from infra.settings import SettingsError, load_settings


def test_defaults_then_file_then_environment(tmp_path: Path):
    config = tmp_path / "selfrag.toml"
    config.write_text("[decoding]\ntop_k = 7\nthreshold = 0.3\n[model]\nn_ctx = 4096\n")
    env = {
        "SELFRAG_HOME": str(tmp_path / "home"),
        "SELFRAG_DECODING__TOP_K": "9",
        "SELFRAG_RETRIEVAL__QDRANT_URL": "http://127.0.0.1:6333",
    }
    s = load_settings(config_path=config, environ=env)
    assert s.home == tmp_path / "home"
    assert s.decoding.top_k == 9  # environment beats the file
    assert s.decoding.threshold == 0.3  # file beats the default
    assert s.decoding.beam == 1  # default
    assert s.model.n_ctx == 4096
    assert s.retrieval.qdrant_url == "http://127.0.0.1:6333"


def test_config_toml_in_home_is_read(tmp_path: Path):
    (tmp_path / "config.toml").write_text("[decoding]\nbeam = 3\n")
    s = load_settings(environ={"SELFRAG_HOME": str(tmp_path)})
    assert s.decoding.beam == 3


def test_bad_value_names_the_field(tmp_path: Path):
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_DECODING__TOP_K": "0"}
    with pytest.raises(SettingsError, match=r"decoding\.top_k"):
        load_settings(environ=env)


def test_unknown_setting_is_rejected(tmp_path: Path):
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_DECODING__TOPK": "3"}
    with pytest.raises(SettingsError, match="topk"):
        load_settings(environ=env)


def test_broken_toml_names_the_file(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[decoding\n")
    with pytest.raises(SettingsError, match=r"bad\.toml"):
        load_settings(config_path=bad, environ={"SELFRAG_HOME": str(tmp_path)})


def test_missing_config_file(tmp_path: Path):
    with pytest.raises(SettingsError, match="not found"):
        load_settings(config_path=tmp_path / "nope.toml", environ={"SELFRAG_HOME": str(tmp_path)})
