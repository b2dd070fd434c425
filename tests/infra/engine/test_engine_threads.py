"""Engine threads and OpenMP's wait policy: the settings, the environment every engine
process starts with (Serve replicas, batch actors, the CLI and the Python API), set before
llama.cpp's OpenMP runtime loads, and the warning when it is too late."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from selfrag.infra.engine import engine_threads
from selfrag.infra.engine.engine_threads import (
    WAIT_POLICY_ENV,
    apply_wait_policy,
    describe,
    effective_threads,
    engine_environment,
    loaded_openmp,
    ray_runtime_env,
)
from selfrag.infra.settings_loader import SettingsError, load_settings
from selfrag.schemas.settings import ModelSettings, Settings
from tests.paths import ROOT

GOMP = "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"


def _maps(tmp_path: Path, *libraries: str) -> Path:
    """A /proc/self/maps with `libraries` mapped (and the usual others)."""
    lines = [
        "55d0c0000000-55d0c0001000 r--p 00000000 08:01 100 /usr/bin/python3.11",
        "7f0000000000-7f0000021000 rw-p 00000000 00:00 0 ",
        "7f0000100000-7f0000200000 r-xp 00000000 08:01 200 /usr/lib/x86_64-linux-gnu/libc.so.6",
        *(f"7f0000300000-7f0000400000 r-xp 00000000 08:01 300 {lib}" for lib in libraries),
        "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]",
    ]
    path = tmp_path / "maps"
    path.write_text("\n".join(lines) + "\n")
    return path


# --- settings ------------------------------------------------------------------------------------


def test_wait_policy_defaults_to_passive_and_is_a_setting(tmp_path: Path):
    assert ModelSettings().omp_wait_policy == "passive"
    assert ModelSettings().n_threads == 0
    env = {
        "SELFRAG_HOME": str(tmp_path),
        "SELFRAG_MODEL__OMP_WAIT_POLICY": "active",
        "SELFRAG_MODEL__N_THREADS": "1",
    }
    model = load_settings(environ=env).model
    assert (model.omp_wait_policy, model.n_threads) == ("active", 1)
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nomp_wait_policy = "inherit"\n')
    assert load_settings(toml, environ={"SELFRAG_HOME": str(tmp_path)}).model.omp_wait_policy == (
        "inherit"
    )


@pytest.mark.parametrize(
    ("variable", "value"),
    [("SELFRAG_MODEL__OMP_WAIT_POLICY", "spin"), ("SELFRAG_MODEL__N_THREADS", "-1")],
)
def test_a_bad_thread_setting_names_its_field_and_variable(tmp_path: Path, variable, value):
    with pytest.raises(SettingsError) as exc:
        load_settings(environ={"SELFRAG_HOME": str(tmp_path), variable: value})
    field = variable.removeprefix("SELFRAG_MODEL__").lower()
    assert f"model.{field} ({variable})" in str(exc.value)


# --- the environment -----------------------------------------------------------------------------


def test_engine_environment_per_policy():
    assert engine_environment(ModelSettings()) == {WAIT_POLICY_ENV: "PASSIVE"}
    assert engine_environment(ModelSettings(omp_wait_policy="active")) == {
        WAIT_POLICY_ENV: "ACTIVE"
    }
    assert engine_environment(ModelSettings(omp_wait_policy="inherit")) == {}


def test_ray_runtime_env_adds_the_variable_and_keeps_the_rest():
    options = {"num_cpus": 0.5, "runtime_env": {"env_vars": {"A": "1"}, "pip": ["x"]}}
    out = ray_runtime_env(ModelSettings(), options)
    assert out == {
        "num_cpus": 0.5,
        "runtime_env": {"env_vars": {"A": "1", WAIT_POLICY_ENV: "PASSIVE"}, "pip": ["x"]},
    }
    assert options["runtime_env"]["env_vars"] == {"A": "1"}  # the caller's dict is not changed
    assert ray_runtime_env(ModelSettings()) == {
        "runtime_env": {"env_vars": {WAIT_POLICY_ENV: "PASSIVE"}}
    }
    assert ray_runtime_env(ModelSettings(omp_wait_policy="inherit"), {"num_cpus": 1}) == {
        "num_cpus": 1
    }


def test_apply_sets_the_variable_while_no_openmp_runtime_is_loaded(tmp_path: Path):
    env: dict[str, str] = {}
    assert apply_wait_policy("passive", env, _maps(tmp_path)) is None
    assert env == {WAIT_POLICY_ENV: "PASSIVE"}
    # The setting replaces another value from the environment, before the runtime loads.
    env = {WAIT_POLICY_ENV: "active"}
    assert apply_wait_policy("passive", env, _maps(tmp_path)) is None
    assert env == {WAIT_POLICY_ENV: "PASSIVE"}
    # inherit leaves the environment as it is.
    env = {WAIT_POLICY_ENV: "ACTIVE"}
    assert apply_wait_policy("inherit", env, _maps(tmp_path, GOMP)) is None
    assert env == {WAIT_POLICY_ENV: "ACTIVE"}


def test_apply_after_the_runtime_loaded_warns_and_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    env: dict[str, str] = {}
    monkey_warned: set[str] = set()
    engine_threads._warned, saved = monkey_warned, engine_threads._warned
    try:
        with caplog.at_level(logging.WARNING, logger="selfrag.engine_threads"):
            warning = apply_wait_policy("passive", env, _maps(tmp_path, GOMP))
            assert apply_wait_policy("passive", env, _maps(tmp_path, GOMP)) == warning
    finally:
        engine_threads._warned = saved
    assert warning is not None
    assert GOMP in warning and "OMP_WAIT_POLICY unset" in warning
    assert "OMP_WAIT_POLICY=PASSIVE" in warning
    assert env == {}
    assert [r.getMessage() for r in caplog.records] == [warning]  # once per process
    # Already the wanted value: nothing to say.
    assert apply_wait_policy("passive", {WAIT_POLICY_ENV: "passive"}, _maps(tmp_path, GOMP)) is None


def test_only_the_runtimes_llama_cpp_links_count(tmp_path: Path):
    renamed = "/venv/lib/python3.11/site-packages/scipy.libs/libgomp-a34b3233.so.1"
    assert loaded_openmp(_maps(tmp_path, renamed)) == []
    torch = "/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1"  # ggml would share it
    assert loaded_openmp(_maps(tmp_path, torch)) == [torch]
    assert loaded_openmp(_maps(tmp_path, GOMP, GOMP)) == [GOMP]
    assert loaded_openmp(_maps(tmp_path, "/opt/llvm/lib/libomp.so")) == ["/opt/llvm/lib/libomp.so"]
    assert loaded_openmp(tmp_path / "no-such-maps") == []


def test_describe_for_status():
    assert describe(ModelSettings(n_threads=1), {}) == {
        "n_threads": 1,
        "threads": 1,
        "omp_wait_policy": "passive",
        WAIT_POLICY_ENV: "PASSIVE",
    }
    inherit = describe(ModelSettings(omp_wait_policy="inherit"), {WAIT_POLICY_ENV: "ACTIVE"})
    assert inherit["threads"] == effective_threads(0) == os.cpu_count()
    assert inherit[WAIT_POLICY_ENV] == "ACTIVE"
    assert describe(ModelSettings(omp_wait_policy="inherit"), {})[WAIT_POLICY_ENV] is None


# --- Ray: Serve replicas and batch actors --------------------------------------------------------


def _bound(app: object) -> Any:
    return app._bound_deployment  # type: ignore[attr-defined]


@pytest.mark.parametrize("replicas", [1, 2])
def test_every_serve_replica_starts_with_the_wait_policy(tmp_path: Path, replicas: int):
    from selfrag.actors.serve_app import build_app

    settings = Settings(home=tmp_path, serve={"pool_replicas": replicas})
    ingress = _bound(build_app(settings))
    deployments = [ingress, *(_bound(a) for a in ingress.init_args[:4])]
    assert [d.name for d in deployments] == [
        "SelfRAGIngress",
        "BranchPool",
        "RetrievalDecider",
        "Retriever",
        "Ranker",
    ]
    for d in deployments:
        assert d.ray_actor_options["runtime_env"]["env_vars"] == {WAIT_POLICY_ENV: "PASSIVE"}
        assert d.ray_actor_options["num_cpus"] > 0  # the deployment's own options kept
    assert deployments[1].ray_actor_options["num_cpus"] == 0.5 / replicas

    active = Settings(home=tmp_path, model={"omp_wait_policy": "active"})
    pool = _bound(_bound(build_app(active)).init_args[0])
    assert pool.ray_actor_options["runtime_env"]["env_vars"] == {WAIT_POLICY_ENV: "ACTIVE"}
    inherit = Settings(home=tmp_path, model={"omp_wait_policy": "inherit"})
    pool = _bound(_bound(build_app(inherit)).init_args[0])
    assert "runtime_env" not in pool.ray_actor_options


def test_the_deployment_files_set_the_default_policy_for_every_process():
    """deploy/serve.yaml's deployments replace the options `build_app` gives them, so the file
    sets the variable for the application; the KubeRay pods start every Ray process with it."""
    import yaml

    default = engine_environment(ModelSettings())
    serve = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    assert serve["applications"][0]["runtime_env"]["env_vars"] == default
    manifest = next(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "rayservice.yaml").read_text()))
    cluster = manifest["spec"]["rayClusterConfig"]
    containers = [
        c
        for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        for c in g["template"]["spec"]["containers"]
    ]
    assert len(containers) >= 2
    for c in containers:
        assert {"name": WAIT_POLICY_ENV, "value": default[WAIT_POLICY_ENV]} in c["env"]


def test_the_batch_actor_pool_starts_with_the_wait_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`stream_answers` hands Ray Data the runtime_env of its engine actors."""
    import ray.data

    from selfrag.jobs.batch import batch_answers
    from selfrag.jobs.ray_pool import Resources
    from selfrag.schemas.decoding import DecodingConfig

    class Stop(Exception):
        pass

    seen: dict[str, Any] = {}

    class Dataset:
        def map_batches(self, fn: Any, **kwargs: Any) -> None:
            seen.update(kwargs)
            raise Stop

    monkeypatch.setattr(batch_answers, "plan_on_cluster", lambda *a, **k: Resources(1, 1.0, 1, 8))
    monkeypatch.setattr(ray.data, "from_items", lambda *a, **k: Dataset())
    settings = Settings(
        home=tmp_path,
        model={"omp_wait_policy": "active"},
        retrieval={"qdrant_url": "http://127.0.0.1:1"},  # no retriever actor to start
    )
    job = batch_answers.BatchJob("k", "q?", DecodingConfig(), ["1"])
    with pytest.raises(Stop):
        list(batch_answers.stream_answers(settings, [job]))
    assert seen["runtime_env"] == {"env_vars": {WAIT_POLICY_ENV: "ACTIVE"}}
    assert seen["num_cpus"] == 1.0


def test_a_ray_actor_process_starts_with_the_variable(ray_tmp: Path, tmp_path: Path):
    """What `ray_runtime_env` gives an actor is in its process environment from the start
    (/proc/self/environ holds the environment a process was started with)."""
    code = textwrap.dedent(
        """
        import json, os, ray
        from selfrag.infra.engine.engine_threads import ray_runtime_env
        from selfrag.schemas.settings import ModelSettings

        @ray.remote
        def environment():
            start = open("/proc/self/environ", "rb").read().split(b"\\0")
            return [e.decode() for e in start if e.startswith(b"OMP_WAIT_POLICY=")]

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:
            opts = ray_runtime_env(ModelSettings(omp_wait_policy="active"), {"num_cpus": 0.5})
            print(json.dumps(ray.get(environment.options(**opts).remote())))
        finally:
            ray.shutdown()
        """
    )
    env = {k: v for k, v in os.environ.items() if k != WAIT_POLICY_ENV}
    env["RAY_TMPDIR"] = str(ray_tmp)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["OMP_WAIT_POLICY=ACTIVE"]


# --- a process that loads the engine itself ------------------------------------------------------


def _openmp_display(code: str, env: dict[str, str]) -> str:
    """stderr of `code` run with libgomp displaying what it started with (OMP_DISPLAY_ENV)."""
    base = {k: v for k, v in os.environ.items() if k != WAIT_POLICY_ENV}
    # No setting of this session's but the suite's model (tests/conftest.py).
    base = {
        k: v
        for k, v in base.items()
        if not k.startswith("SELFRAG_") or k == "SELFRAG_MODEL__PRESET"
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.mark.parametrize(
    ("policy", "spin"), [(None, "'0'"), ("active", None), ("inherit", "'300000'")]
)
def test_the_engine_process_starts_openmp_with_the_setting(
    llama_model: Path, tmp_path: Path, policy: str | None, spin: str | None
):
    """The Python API's engine (and so `selfrag ask`, `index`, in-process `eval`) loads
    llama.cpp's OpenMP runtime with the configured wait policy: libgomp itself says so."""
    env = {"SELFRAG_HOME": str(tmp_path), "SELFRAG_MODEL__N_THREADS": "1"}
    if policy is not None:
        env["SELFRAG_MODEL__OMP_WAIT_POLICY"] = policy
    err = _openmp_display(
        """
        from selfrag import SelfRAG
        with SelfRAG.open() as rag:
            rag.system.engine
        """,
        env,
    )
    # The store's embedder (torch, or llama.cpp) first, as `selfrag ask` and `index` do.
    err_store = _openmp_display(
        """
        from selfrag import SelfRAG
        with SelfRAG.open() as rag:
            rag.system.embedder
            rag.system.engine
        """,
        env,
    )
    wanted = {None: "PASSIVE", "active": "ACTIVE", "inherit": "PASSIVE"}[policy]
    for shown in (err, err_store):
        assert f"OMP_WAIT_POLICY = '{wanted}'" in shown, shown[-2000:]
        # libgomp shows an unset policy as PASSIVE too; its spin count tells them apart.
        if spin is not None:
            assert f"GOMP_SPINCOUNT = {spin}" in shown, shown[-2000:]
        else:
            assert "GOMP_SPINCOUNT = '0'" not in shown and "'300000'" not in shown
        assert "was loaded in this process" not in shown  # set before, not too late


def test_a_runtime_loaded_before_the_setting_is_reported():
    err = _openmp_display(
        """
        import ctypes, logging
        logging.basicConfig()
        ctypes.CDLL("libgomp.so.1")  # as a library loaded before selfrag's engine would
        from selfrag.infra.engine.engine_threads import apply_wait_policy
        assert apply_wait_policy("passive") is not None
        """,
        {},
    )
    assert "GOMP_SPINCOUNT = '300000'" in err
    assert "before model.omp_wait_policy=passive could set OMP_WAIT_POLICY=PASSIVE" in err
