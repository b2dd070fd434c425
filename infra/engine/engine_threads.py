"""How an engine's process runs llama.cpp's threads: their count and OpenMP's wait policy.

ggml's CPU backend computes a graph on an OpenMP team whose threads meet at a barrier after
every operation, and wait between graphs. libgomp's threads spin while they wait (by default
some 300,000 rounds before they sleep; with `OMP_WAIT_POLICY=ACTIVE` for ever). On cores the
engine shares with another busy process, a spinning thread holds a core the thread it waits for
needs, and a decode step stalls (notes/benchmarks.md has what it cost beside one busy
process). With `OMP_WAIT_POLICY=PASSIVE` a waiting thread sleeps at once.

libgomp reads `OMP_WAIT_POLICY` once, when it is loaded, which is when llama.cpp's CPU backend
is. So the variable must be in the process's environment before that: Ray actors and Serve
replicas get it in the `runtime_env` Ray starts them with (`ray_runtime_env`), and a process
that loads the engine itself puts it into `os.environ` first (`apply_wait_policy`, called by
`runtime.model_artefacts` before anything imports llama_cpp); the backend probe's child processes
inherit it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from selfrag.schemas.settings import ModelSettings, WaitPolicy

log = logging.getLogger("selfrag.engine_threads")

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
# The OpenMP runtimes a llama.cpp build links, by soname (GCC's, LLVM's, Intel's). The dynamic
# linker hands ggml one already loaded under that soname, wherever its file is (torch ships
# `torch/lib/libgomp.so.1`: importing torch first starts the runtime ggml then shares); a copy
# renamed by auditwheel (`libgomp-<hash>.so.1`) is a runtime of its own and does not count.
_OPENMP_LIBRARY = re.compile(r"^lib(gomp|omp|iomp5)\.so(\.\d+)*$")


def effective_threads(n_threads: int) -> int:
    """The llama.cpp threads an engine runs for `model.n_threads` (0: all cores)."""
    return n_threads or os.cpu_count() or 1


def wait_policy_value(policy: WaitPolicy) -> str | None:
    """`OMP_WAIT_POLICY`'s value for `model.omp_wait_policy`; None for `inherit` (left as the
    environment has it)."""
    return None if policy == "inherit" else policy.upper()


def engine_environment(model: ModelSettings) -> dict[str, str]:
    """The variables an engine's process needs in its environment before llama.cpp loads."""
    value = wait_policy_value(model.omp_wait_policy)
    return {} if value is None else {WAIT_POLICY_ENV: value}


def ray_runtime_env(model: ModelSettings, options: Mapping[str, Any] | None = None) -> dict:
    """`options` (a Ray actor's or Serve replica's `ray_actor_options`) with the engine's
    variables added to its `runtime_env`'s `env_vars`: Ray sets them in the worker process
    before any of its code runs. Ray merges them with the job's and application's own
    `env_vars`."""
    out = dict(options or {})
    env = engine_environment(model)
    if env:
        runtime_env = dict(out.get("runtime_env") or {})
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env}
        out["runtime_env"] = runtime_env
    return out


def loaded_openmp(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """The OpenMP runtimes (`libgomp.so.1`, ...) already mapped into this process, by path;
    empty where /proc cannot tell."""
    try:
        text = maps.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    found: dict[str, None] = {}
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5].strip() if len(fields) == 6 else ""
        if path and _OPENMP_LIBRARY.match(os.path.basename(path)):
            found[path] = None
    return list(found)


_warned_lock = threading.Lock()
_warned: set[str] = set()


def apply_wait_policy(
    policy: WaitPolicy,
    environ: MutableMapping[str, str] | None = None,
    maps: Path = Path("/proc/self/maps"),
) -> str | None:
    """Put `OMP_WAIT_POLICY` for `policy` into this process's environment, which llama.cpp's
    OpenMP runtime reads when it loads. Where a runtime is already loaded with another value
    it is too late: the warning saying so is logged (once per process and value) and
    returned; None otherwise."""
    env = os.environ if environ is None else environ
    wanted = wait_policy_value(policy)
    current = env.get(WAIT_POLICY_ENV)
    if wanted is None or (current or "").strip().upper() == wanted:
        return None
    loaded = loaded_openmp(maps)
    if loaded:
        had = f"{WAIT_POLICY_ENV}={current}" if current else f"{WAIT_POLICY_ENV} unset"
        warning = (
            f"the OpenMP runtime {loaded[0]} was loaded in this process ({had}) before "
            f"model.omp_wait_policy={policy} could set {WAIT_POLICY_ENV}={wanted}; llama.cpp's "
            f"threads keep the policy it started with. Set {WAIT_POLICY_ENV}={wanted} in the "
            "environment the process starts with"
        )
        with _warned_lock:
            first = wanted not in _warned
            _warned.add(wanted)
        if first:
            log.warning("%s", warning)
        return warning
    if current:
        log.info(
            "model.omp_wait_policy=%s replaces %s=%s from the environment (inherit keeps it)",
            policy,
            WAIT_POLICY_ENV,
            current,
        )
    env[WAIT_POLICY_ENV] = wanted
    return None


def describe(model: ModelSettings, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What an engine process of these settings runs with, for `selfrag status`: the threads
    (the setting and what it resolves to on this machine) and the wait policy (the setting and
    the `OMP_WAIT_POLICY` its engine gets; for `inherit`, this process's)."""
    env = os.environ if environ is None else environ
    value = wait_policy_value(model.omp_wait_policy)
    return {
        "n_threads": model.n_threads,
        "threads": effective_threads(model.n_threads),
        "omp_wait_policy": model.omp_wait_policy,
        WAIT_POLICY_ENV: value if value is not None else env.get(WAIT_POLICY_ENV),
    }
