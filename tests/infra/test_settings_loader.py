import json
import logging
import pickle
from pathlib import Path

import pytest

from selfrag.actors.http.routes import parse_api_keys
from selfrag.cli import main
from selfrag.infra.settings_loader import SettingsError, load_settings
from selfrag.schemas.settings import Settings, mask_url


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


def test_overrides_beat_the_environment_and_merge_into_sections(tmp_path: Path):
    config = tmp_path / "c.toml"
    config.write_text("[model]\nn_ctx = 1024\nn_batch = 128\n")
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_MODEL__N_THREADS": "2"}
    s = load_settings(config_path=config, environ=env, overrides={"model": {"n_batch": 64}})
    assert (s.model.n_ctx, s.model.n_threads, s.model.n_batch) == (1024, 2, 64)
    s = load_settings(environ=env, overrides={"model": {"n_threads": 7}})
    assert s.model.n_threads == 7


def test_config_file_lookup_order(tmp_path: Path):
    home, named, flag = tmp_path / "home", tmp_path / "named.toml", tmp_path / "flag.toml"
    home.mkdir()
    (home / "config.toml").write_text("[decoding]\nbeam = 2\n")
    named.write_text("[decoding]\nbeam = 3\n")
    flag.write_text("[decoding]\nbeam = 4\n")
    env = {"SELFRAG_HOME": str(home)}
    assert load_settings(environ=env).decoding.beam == 2
    env["SELFRAG_CONFIG"] = str(named)
    assert load_settings(environ=env).decoding.beam == 3
    assert load_settings(config_path=flag, environ=env).decoding.beam == 4


def test_a_typo_in_the_config_file_names_the_field(tmp_path: Path):
    config = tmp_path / "c.toml"
    config.write_text('[model]\npathh = "/models/x.gguf"\n')
    with pytest.raises(SettingsError, match=r"c\.toml.*model\.pathh: Extra inputs"):
        load_settings(config_path=config, environ={"SELFRAG_HOME": str(tmp_path)})


def test_the_result_is_a_plain_settings_that_reads_no_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("SELFRAG_DECODING__TOP_K", "9")
    assert type(load_settings(environ={"SELFRAG_HOME": str(tmp_path)})) is Settings
    assert Settings(home=tmp_path).decoding.top_k == 3  # constructing one reads nothing


def test_overrides_cannot_reach_the_loaders_own_options(tmp_path: Path):
    """Init arguments starting with "_" configure pydantic-settings (`_env_file`,
    `_cli_parse_args`): as overrides (`serve run selfrag.ray_app:app_builder _env_file=x`) they
    are refused like any unknown setting."""
    env = {"SELFRAG_HOME": str(tmp_path)}
    with pytest.raises(SettingsError, match="unknown setting _cli_parse_args"):
        load_settings(environ=env, overrides={"_cli_parse_args": True})


# --- environment names and values -----------------------------------------------------------

# What Kubernetes injects for the selfrag-serve-svc Service KubeRay creates for a RayService
# named selfrag (enableServiceLinks defaults to true).
SERVICE_LINKS = {
    "SELFRAG_SERVE_SVC_SERVICE_HOST": "10.96.0.12",
    "SELFRAG_SERVE_SVC_SERVICE_PORT": "8000",
    "SELFRAG_SERVE_SVC_SERVICE_PORT_SERVE": "8000",
    "SELFRAG_SERVE_SVC_PORT": "tcp://10.96.0.12:8000",
    "SELFRAG_SERVE_SVC_PORT_8000_TCP": "tcp://10.96.0.12:8000",
    "SELFRAG_SERVE_SVC_PORT_8000_TCP_PROTO": "tcp",
    "SELFRAG_SERVE_SVC_PORT_8000_TCP_PORT": "8000",
    "SELFRAG_SERVE_SVC_PORT_8000_TCP_ADDR": "10.96.0.12",
}


def test_kubernetes_service_links_are_ignored_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.WARNING, logger="selfrag.settings")
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_DECODING__TOP_K": "4", **SERVICE_LINKS}
    first = load_settings(environ=env)
    second = load_settings(environ=env)
    assert first.decoding.top_k == second.decoding.top_k == 4
    assert first.serve == second.serve  # the serve section is untouched by SELFRAG_SERVE_SVC_*
    warnings = [r for r in caplog.records if r.name == "selfrag.settings"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert all(name in message for name in SERVICE_LINKS)
    assert "10.96.0.12" not in message  # names only: a value may be anything


def test_api_keys_and_config_variables_are_not_reported_as_unknown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.WARNING, logger="selfrag.settings")
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_API_KEYS": "k1", "SELFRAG_CONFIG": ""}
    load_settings(environ=env)
    assert not [r for r in caplog.records if r.name == "selfrag.settings"]


def test_a_typo_inside_a_known_section_is_an_error_naming_the_variable(tmp_path: Path):
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_MODEL__PATHH": "/models/x.gguf"}
    with pytest.raises(SettingsError, match=r"SELFRAG_MODEL__PATHH.*model\.pathh.*mean path"):
        load_settings(environ=env)
    with pytest.raises(SettingsError, match="SELFRAG_HOME__X: home is a value"):
        load_settings(environ={"SELFRAG_HOME": str(tmp_path), "SELFRAG_HOME__X": "1"})


def test_values_are_parsed_by_the_field_type_not_as_json(tmp_path: Path):
    env = {
        "SELFRAG_HOME": str(tmp_path),
        "SELFRAG_RETRIEVAL__QDRANT_API_KEY": "12345",
        "SELFRAG_MODEL__PATH": "123",
        "SELFRAG_RETRIEVAL__COLLECTION": "true",
        "SELFRAG_DECODING__TOP_K": "5",
        "SELFRAG_DECODING__THRESHOLD": "0.25",
        "SELFRAG_RETRIEVAL__HYBRID": "false",
        "SELFRAG_SERVE__LOG_QUESTIONS": "1",
        "SELFRAG_CACHE__QUERY": "0",
        "SELFRAG_MODEL__VLLM_URL": "",  # an empty optional value: unset
        "SELFRAG_CALIBRATION__SUPPORT": '{"a": 2.0, "b": -1.0}',  # a whole section: JSON
    }
    s = load_settings(environ=env)
    assert s.retrieval.qdrant_api_key is not None
    assert s.retrieval.qdrant_api_key.get_secret_value() == "12345"
    assert s.model.path == "123"
    assert s.retrieval.collection == "true"
    assert s.decoding.top_k == 5 and s.decoding.threshold == 0.25
    assert s.retrieval.hybrid is False and s.serve.log_questions is True and s.cache.query is False
    assert s.model.vllm_url is None
    assert (s.calibration.support.a, s.calibration.support.b) == (2.0, -1.0)


def test_a_bad_environment_value_names_its_variable(tmp_path: Path):
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_RETRIEVAL__HYBRID": "maybe"}
    with pytest.raises(SettingsError, match=r"retrieval\.hybrid \(SELFRAG_RETRIEVAL__HYBRID\)"):
        load_settings(environ=env)
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_CALIBRATION__SUPPORT": "{a: 2"}
    with pytest.raises(SettingsError, match="SELFRAG_CALIBRATION__SUPPORT: expected a JSON"):
        load_settings(environ=env)
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_MODEL": "5", "SELFRAG_MODEL__N_CTX": "4096"}
    # A section is a JSON object.
    with pytest.raises(SettingsError, match=r"model \(SELFRAG_MODEL\): .*valid dictionary"):
        load_settings(environ=env)


def test_a_field_variable_beats_its_section_as_json(tmp_path: Path):
    env = {
        "SELFRAG_HOME": str(tmp_path),
        "SELFRAG_MODEL": '{"n_ctx": 4096, "n_threads": 3}',
        "SELFRAG_MODEL__N_CTX": "2048",
    }
    s = load_settings(environ=env)
    assert (s.model.n_ctx, s.model.n_threads) == (2048, 3)


def test_an_empty_variable_is_as_if_it_were_not_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    config = tmp_path / "c.toml"
    config.write_text('redis_url = "redis://file:6379/0"\n[model]\nvllm_url = "http://file"\n')
    env = {
        "SELFRAG_HOME": str(tmp_path),
        "SELFRAG_REDIS_URL": "",
        "SELFRAG_MODEL__VLLM_URL": "",
        "SELFRAG_DECODING__TOP_K": "",
    }
    s = load_settings(config_path=config, environ=env)
    assert s.redis_url is not None and "file" in s.redis_url.get_secret_value()
    assert s.model.vllm_url == "http://file"  # the file's value stands
    assert s.decoding.top_k == 3  # the default, not an error
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert load_settings(environ={"SELFRAG_HOME": ""}).home == tmp_path / "xdg" / "selfrag"


def test_names_after_the_prefix_are_case_insensitive_the_prefix_is_not(tmp_path: Path):
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_Model__N_Threads": "5"}
    assert load_settings(environ=env).model.n_threads == 5
    env = {"SELFRAG_HOME": str(tmp_path), "selfrag_model__n_threads": "5"}
    assert load_settings(environ=env).model.n_threads == 0


def test_numeric_api_keys_stay_text():
    assert [k.get_secret_value() for k in parse_api_keys("12345, 007")] == ["12345", "007"]


# --- secrets ----------------------------------------------------------------------------------

QDRANT_KEY = "qdrant-s3cret-7f3a"
REDIS_PASSWORD = "redis-s3cret-91c2"


def _secret_env(home: Path) -> dict[str, str]:
    return {
        "SELFRAG_HOME": str(home),
        "SELFRAG_RETRIEVAL__QDRANT_API_KEY": QDRANT_KEY,
        "SELFRAG_REDIS_URL": f"redis://:{REDIS_PASSWORD}@redis.internal:6379/0",
    }


def test_secrets_are_masked_everywhere_they_are_shown(tmp_path: Path):
    s = load_settings(environ=_secret_env(tmp_path))
    shown = [repr(s), str(s), s.model_dump_json(), json.dumps(s.model_dump(mode="json"))]
    for text in shown:
        assert QDRANT_KEY not in text and REDIS_PASSWORD not in text
    # The Redis URL still shows where it points.
    assert s.model_dump(mode="json")["redis_url"] == "redis://:**********@redis.internal:6379/0"
    assert s.retrieval.qdrant_api_key is not None and s.redis_url is not None
    assert s.retrieval.qdrant_api_key.get_secret_value() == QDRANT_KEY
    assert REDIS_PASSWORD in s.redis_url.get_secret_value()


def test_secrets_reach_ray_actors_intact(tmp_path: Path):
    """Ray pickles actor arguments (jobs/batch/batch_answers.py passes the Settings object): the
    secret survives for the consumer, and the reprs Ray may log stay masked."""
    s = pickle.loads(pickle.dumps(load_settings(environ=_secret_env(tmp_path))))
    assert s.retrieval.qdrant_api_key is not None and s.redis_url is not None
    assert s.retrieval.qdrant_api_key.get_secret_value() == QDRANT_KEY
    assert s.redis_url.get_secret_value().startswith(f"redis://:{REDIS_PASSWORD}@")
    assert QDRANT_KEY not in repr(s) and REDIS_PASSWORD not in repr(s)


def test_an_invalid_secret_is_not_echoed(tmp_path: Path):
    config = tmp_path / "c.toml"
    config.write_text("[retrieval]\nqdrant_api_key = 424242\n")
    with pytest.raises(SettingsError, match=r"retrieval\.qdrant_api_key") as info:
        load_settings(config_path=config, environ={"SELFRAG_HOME": str(tmp_path)})
    assert "424242" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("redis://:pw@redis:6379/0", "redis://:**********@redis:6379/0"),
        ("rediss://app:pw@[::1]:6380", "rediss://app:**********@[::1]:6380"),
        ("redis://redis/0?password=pw&db=1", "redis://redis/0?password=**********&db=1"),
        ("redis://[bad", "**********"),
    ],
)
def test_mask_url(url: str, shown: str):
    assert mask_url(url) == shown


@pytest.mark.parametrize("as_json", [False, True])
def test_selfrag_config_never_prints_a_secret(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    as_json: bool,
):
    for name, value in _secret_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    rc = main(["--home", str(tmp_path), "config", *(["--json"] if as_json else [])])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert QDRANT_KEY not in out + err and REDIS_PASSWORD not in out + err
    assert "**********" in out and "redis.internal:6379" in out
