"""deploy/serve.yaml and the KubeRay manifest name the deployments that exist, validly, and do
not expose the API or the Ray dashboard silently; `selfrag serve` and the app build warn when
the API binds a public address without API keys."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr
from ray.serve.schema import ServeDeploySchema

from selfrag.actors.serve_app import serve_logging
from selfrag.cli import main
from selfrag.infra.settings_loader import (
    API_KEYS_ENV,
    SettingsError,
    exposure_warning,
    is_loopback,
    load_settings,
)
from selfrag.schemas.settings import Settings
from tests.paths import ROOT

DEPLOYMENTS = {"SelfRAGIngress", "RetrievalDecider", "BranchPool", "Retriever", "Ranker"}


def _check(config: dict) -> None:
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    assert app.import_path == "selfrag.ray_app:app"
    names = {d.name for d in app.deployments}
    assert names == DEPLOYMENTS
    for d in app.deployments:
        auto = d.autoscaling_config
        assert auto["min_replicas"] <= auto["max_replicas"]
        assert auto["target_ongoing_requests"] > 0


def test_serve_yaml_is_a_valid_serve_config():
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    _check(config)
    retriever = next(
        d for d in config["applications"][0]["deployments"] if d["name"] == "Retriever"
    )
    # Embedded Qdrant: one client per folder, on the node labelled as holding it.
    assert retriever["autoscaling_config"]["max_replicas"] == 1
    assert retriever["ray_actor_options"]["label_selector"] == {"selfrag-index": "true"}
    assert (
        sum(d["ray_actor_options"]["num_cpus"] for d in config["applications"][0]["deployments"])
        <= 2
    )
    # The same defaults as `selfrag serve` (serve.ray_access_log, log_encoding, log_level).
    assert config["logging_config"] == serve_logging(Settings(home=Path("/nonexistent")))


def test_rayservice_manifest_embeds_a_valid_serve_config():
    manifest = _manifest()[0]
    assert manifest["kind"] == "RayService"
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    _check(config)
    assert config["logging_config"] == serve_logging(Settings(home=Path("/nonexistent")))


def test_serve_logging_settings_reach_rays_logging_config():
    from ray.serve.schema import EncodingType, LoggingConfig

    settings = Settings(
        home=Path("/nonexistent"),
        serve={"log_encoding": "JSON", "log_level": "DEBUG", "ray_access_log": True},
    )
    config = LoggingConfig(**serve_logging(settings))
    assert config.encoding == EncodingType.JSON and config.log_level == "DEBUG"
    assert config.enable_access_log is True
    with pytest.raises(ValueError, match="log_encoding"):
        Settings(home=Path("/nonexistent"), serve={"log_encoding": "XML"})


def test_a_replica_logs_selfrags_records_where_serve_logs_its_own(
    monkeypatch: pytest.MonkeyPatch,
):
    """`adopt_serve_logging`: selfrag's loggers use Serve's handlers (its replica log file, in
    the configured encoding) at serve.log_level; outside a replica nothing changes."""
    from selfrag.actors.deployments import adopt_serve_logging
    from selfrag.runtime.ray_logs import SERVE_TO_STDERR_ENV, is_terminal_handler

    monkeypatch.delenv(SERVE_TO_STDERR_ENV, raising=False)  # Serve logs to stderr too

    serve_logger = logging.getLogger("test.adopt.serve")
    ours = logging.getLogger("test.adopt.selfrag")
    assert adopt_serve_logging("DEBUG", serve_logger=serve_logger.name, ours=ours.name) is False
    assert ours.handlers == [] and ours.propagate

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    serve_logger.addHandler(handler)
    try:
        assert adopt_serve_logging("WARNING", serve_logger=serve_logger.name, ours=ours.name)
        adopt_serve_logging("WARNING", serve_logger=serve_logger.name, ours=ours.name)
        logging.getLogger("test.adopt.selfrag.http").info("not at WARNING")
        logging.getLogger("test.adopt.selfrag.http").warning("kept once")
        assert [r.getMessage() for r in records] == ["kept once"]
        assert ours.handlers == [handler] and not ours.propagate
        # With Serve's records in its files only, one terminal handler, however often adopted.
        monkeypatch.setenv(SERVE_TO_STDERR_ENV, "0")
        adopt_serve_logging("WARNING", serve_logger=serve_logger.name, ours=ours.name)
        adopt_serve_logging("WARNING", serve_logger=serve_logger.name, ours=ours.name)
        assert sum(map(is_terminal_handler, ours.handlers)) == 1
    finally:
        serve_logger.removeHandler(handler)
        ours.handlers.clear()
        ours.propagate = True
        ours.setLevel(logging.NOTSET)


def _manifest() -> tuple[dict[str, Any], str]:
    """The RayService of deploy/k8s/rayservice.yaml, and the file's text."""
    text = (ROOT / "deploy" / "k8s" / "rayservice.yaml").read_text()
    return next(d for d in yaml.safe_load_all(text) if d["kind"] == "RayService"), text


def _pod_specs(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [g["template"]["spec"] for g in groups]


def test_rayservice_pods_get_no_service_link_variables():
    """Service links would inject SELFRAG_SERVE_SVC_* (the selfrag-serve-svc Service) into the
    settings' namespace."""
    specs = _pod_specs(_manifest()[0])
    assert len(specs) >= 2
    assert all(spec.get("enableServiceLinks") is False for spec in specs)


def test_rayservice_keeps_selfrag_home_on_a_claim_every_worker_mounts():
    """Derived weights under SELFRAG_HOME survive a pod: a volume claim, never an emptyDir,
    and one that all worker pods can mount at once."""
    manifest, text = _manifest()
    home = next(
        v["value"]
        for v in manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
            "containers"
        ][0]["env"]
        if v["name"] == "SELFRAG_HOME"
    )
    claims = {
        d["metadata"]["name"]: d
        for d in yaml.safe_load_all(text)
        if d["kind"] == "PersistentVolumeClaim"
    }
    for group in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = spec["containers"][0]["volumeMounts"]
        under = [m for m in mounts if home.startswith(m["mountPath"].rstrip("/") + "/")]
        assert len(under) == 1 and not under[0].get("readOnly"), mounts
        volume = volumes[under[0]["name"]]
        assert "emptyDir" not in volume, volume
        claim = claims[volume["persistentVolumeClaim"]["claimName"]]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_rayservice_api_key_secret_is_required():
    """An optional Secret that is missing would start the pods with authentication off."""
    refs = []
    for spec in _pod_specs(_manifest()[0]):
        for container in spec["containers"]:
            for var in container.get("env", []):
                if var["name"] == API_KEYS_ENV:
                    refs.append(var["valueFrom"]["secretKeyRef"])
    assert refs, "every container should read SELFRAG_API_KEYS from the Secret"
    assert all(ref.get("optional", False) is False and ref["name"] for ref in refs)


def test_rayservice_dashboard_is_not_published_silently():
    manifest, text = _manifest()
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]
    host = head["rayStartParams"].get("dashboard-host", "127.0.0.1")
    if is_loopback(host):
        return
    # KubeRay reaches the dashboard over the head Service to deploy serveConfigV2, so it binds
    # all interfaces; then the Service stays cluster-internal and the manifest says why.
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "dashboard-host:" in line)
    comment = " ".join(lines[max(0, at - 10) : at])
    assert "ARBITRARY CODE" in comment and "Jobs API" in comment


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("selfrag.example.com", False),
    ],
)
def test_is_loopback(host: str, loopback: bool):
    assert is_loopback(host) is loopback


def test_exposure_warning_only_for_a_public_bind_without_keys():
    assert exposure_warning("127.0.0.1", []) is None
    assert exposure_warning("0.0.0.0", [SecretStr("k")]) is None
    warning = exposure_warning("0.0.0.0", [])
    assert warning is not None and "0.0.0.0" in warning and API_KEYS_ENV in warning


def test_selfrag_serve_on_a_public_address_without_keys_warns_at_start(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.WARNING, logger="selfrag.settings")
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    # A model that does not exist stops the command right after the warning, before Ray.
    monkeypatch.setenv("SELFRAG_MODEL__PATH", str(tmp_path / "missing.gguf"))
    rc = main(["--home", str(tmp_path), "serve", "--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert rc != 0 and "missing.gguf" in err
    assert "WARNING" in err and "0.0.0.0" in err and API_KEYS_ENV in err
    assert err.count("binds 0.0.0.0") == 1, err  # shown once, not logged and printed
    assert any(r.levelno == logging.WARNING and "0.0.0.0" in r.getMessage() for r in caplog.records)


def test_selfrag_serve_with_keys_does_not_warn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setenv(API_KEYS_ENV, "k1")
    monkeypatch.setenv("SELFRAG_MODEL__PATH", str(tmp_path / "missing.gguf"))
    rc = main(["--home", str(tmp_path), "serve", "--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert rc != 0 and "missing.gguf" in err and "WARNING" not in err


def _run_python(code: str, env: dict[str, str], timeout: float = 120) -> str:
    """Run `code` in a fresh interpreter (no Ray of this session in it); returns stderr."""
    # No setting of this session's but the suite's model (tests/conftest.py).
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SELFRAG_") or k == "SELFRAG_MODEL__PRESET"
    }
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**base, "RAY_AUTH_MODE": "disabled", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


BUILD_ON_PUBLIC_HOST = """
    from selfrag.actors.serve_app import build_app
    from selfrag.infra.settings_loader import load_settings
    build_app(load_settings())
"""


def test_app_build_binding_a_public_address_without_keys_warns(tmp_path: Path):
    """What `serve deploy deploy/serve.yaml` runs when no Serve answers for the address."""
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_SERVE__HOST": "0.0.0.0"}
    err = _run_python(BUILD_ON_PUBLIC_HOST, env)
    assert "WARNING" in err and "binds 0.0.0.0" in err and API_KEYS_ENV in err
    quiet = _run_python(BUILD_ON_PUBLIC_HOST, {**env, API_KEYS_ENV: "k1"})
    assert "binds 0.0.0.0" not in quiet


def test_app_build_checks_the_address_serve_really_binds(ray_tmp: Path, tmp_path: Path):
    """deploy/serve.yaml and KubeRay set the proxies' address themselves: the build asks the
    running Serve controller (here a loopback one, so no warning even though serve.host says
    0.0.0.0)."""
    code = """
        import ray
        from ray import serve
        from tests.redis_proc import free_port
        from selfrag.actors.serve_app import build_app, serve_http_host
        from selfrag.infra.settings_loader import load_settings

        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
            assert serve_http_host() == "127.0.0.1", serve_http_host()
            build_app(load_settings())
        finally:
            serve.shutdown()
            ray.shutdown()
    """
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_SERVE__HOST": "0.0.0.0"}
    err = _run_python(code, env | {"RAY_TMPDIR": str(ray_tmp)}, timeout=300)
    assert "binds 0.0.0.0" not in err and "binds 127.0.0.1" not in err


def _bound(app: object) -> Any:
    """The deployment an `Application` binds (Ray has no public accessor)."""
    return app._bound_deployment  # type: ignore[attr-defined]


@pytest.mark.parametrize(("replicas", "cpus"), [(1, 0.5), (2, 0.25), (4, 0.125)])
def test_pool_replicas_share_the_pools_cpu_reservation(tmp_path: Path, replicas, cpus):
    """Two pools at 0.5 CPU each would not fit a 2-CPU machine beside the other deployments."""
    from selfrag.actors.serve_app import build_app

    settings = Settings(home=tmp_path, serve={"pool_replicas": replicas})
    pool = _bound(_bound(build_app(settings)).init_args[0])
    assert pool.name == "BranchPool"
    assert pool.ray_actor_options["num_cpus"] == cpus
    assert pool.num_replicas == replicas


def test_the_ingress_gets_the_address_serve_really_binds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """deploy/serve.yaml binds 0.0.0.0 while serve.host says 127.0.0.1: the ingress must not
    take itself for a loopback server (its Host check would refuse every remote client)."""
    from selfrag.actors import serve_app as app

    settings = Settings(home=tmp_path, serve={"allowed_hosts": ["rag.internal"]})
    monkeypatch.setattr(app, "serve_http_host", lambda: "0.0.0.0")
    monkeypatch.setenv(API_KEYS_ENV, "k1")  # no exposure warning
    ingress = _bound(app.build_app(settings))
    assert ingress.name == "SelfRAGIngress"
    given = ingress.init_args[4].serve
    assert (given.host, given.allowed_hosts) == ("0.0.0.0", ["rag.internal"])
    monkeypatch.setattr(app, "serve_http_host", lambda: None)
    assert _bound(app.build_app(settings)).init_args[4].serve.host == "127.0.0.1"


def test_allowed_hosts_come_from_the_environment_as_json(tmp_path: Path):
    env = {"SELFRAG_HOME": str(tmp_path)}
    names = '["rag.example.com", "[::2]", "*"]'
    settings = load_settings(environ={**env, "SELFRAG_SERVE__ALLOWED_HOSTS": names})
    assert settings.serve.allowed_hosts == ["rag.example.com", "[::2]", "*"]
    with pytest.raises(SettingsError, match="allowed_hosts"):
        load_settings(environ={**env, "SELFRAG_SERVE__ALLOWED_HOSTS": '["a.example:8000"]'})
