"""Load llama.cpp's CPU backend so that a model runs on this CPU, or say clearly why not.

llama-cpp-python as `scripts/install.sh` builds it (`GGML_BACKEND_DL` with `GGML_CPU_ALL_VARIANTS`)
ships one CPU backend library per instruction-set level built: the building CPU's best and the
x86-64 baseline (`libggml-cpu-zen4.so`, `libggml-cpu-x64.so`), or with `--portable` six
(`…-haswell.so`, `…-sapphirerapids.so`, …). ggml would load the best one its `cpuid` check allows,
but a CPU can advertise a feature that is not usable: inside some VMs an Intel Xeon reports AMX,
and the first AMX instruction (`tilezero`, in the quantized matmul kernel) kills the process with
SIGILL. So before a process loads a model for the first time, a child process loads that model with
a candidate backend and decodes a few tokens (the probe). The best candidate that survives is
loaded into this process; one that dies is reported with the CPU features only it needs. Probe
results are kept on disk per model file, backend library and CPU, so each combination is probed
once per machine. A process left with the baseline where this CPU has a better level the build
lacks (a venv built on another machine) runs, with a warning that says how to build for it.

A build without variants (one built-in CPU backend) is probed the same way: a crash becomes an
`EngineError` naming the model file and the features the build was compiled for.

`SELFRAG_CPU_BACKEND=NAME` (`CPU_BACKEND_ENV`, e.g. `haswell`, `x64`) limits the choice to that
backend, when this CPU runs it: to see on one machine what another computes (an AVX2-only CI
runner), or to rule out one backend.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from selfrag.infra.engine.cpu_builds.cpu_variants import (
    CPU_BACKEND_ENV,
    BackendError,
    Variant,
    cpu_flags,
    library_dir,
    missing_level_warning,
    variant_files,
    variant_name,
)
from selfrag.infra.engine.cpu_builds.llama_init import init_llama, route_llama_log
from selfrag.infra.file_lock import write_atomic

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 300.0
PROBE_FORMAT = 2
PROBE_PROMPT = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to "
    "Normandy, a region in France. They were descended from Norse raiders and pirates."
)
BUILTIN = "built-in"


@dataclass(frozen=True)
class ProbeResult:
    """How a child process fared loading a model with one backend and decoding a few tokens."""

    ok: bool
    detail: str
    """Empty when ok; else the signal or exit status and the end of the child's stderr."""
    signal_name: str | None = None


@functools.cache
def cpu_signature() -> str:
    """What identifies this CPU for the probe cache: model name and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    keep = [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith(("model name", "flags", "vendor_id", "Features", "CPU part"))
    ]
    # Every core repeats the same lines; one copy of each is enough.
    unique = sorted(set(keep)) or [os.uname().machine]
    return hashlib.sha256("\n".join(unique).encode()).hexdigest()[:16]


def _file_id(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def _build_version() -> str:
    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return "unknown"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfrag" / "llama-probes"


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The child must import this checkout's `infra`, wherever the parent runs from.
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _run_child(args: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "selfrag.infra.engine.cpu_builds.llama_probe", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=_child_env(),
        check=False,
    )


def rank_variants(files: Sequence[Path], timeout_s: float = 60.0) -> list[Variant]:
    """The variants ggml's `cpuid` check accepts on this CPU, best first.

    Each library is scored in a child process of its own: loading it runs its static
    initialisers, compiled for its instruction set, so one that cannot even load here only
    drops out of the ranking.
    """
    ranked = []
    for path in files:
        try:
            done = _run_child(["score", str(path)], timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("llama.cpp CPU backend %s: no score within %g s", path.name, timeout_s)
            continue
        if done.returncode != 0:
            logger.info(
                "llama.cpp CPU backend %s unusable here: %s", path.name, _status(done.returncode)
            )
            continue
        score = int(done.stdout.strip() or 0)
        if score > 0:
            ranked.append(Variant(variant_name(path), path, score))
    return sorted(ranked, key=lambda v: -v.score)


def _status(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(text.strip().splitlines()[-lines:]) or "no output"


class ProbeCache:
    """Probe results on disk, one small JSON file per key; keys name the model file, the backend
    library, the llama.cpp build and the CPU, so any change to one of them probes again."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @staticmethod
    def key(*parts: str) -> str:
        fields = [str(PROBE_FORMAT), _build_version(), cpu_signature(), *parts]
        return hashlib.sha256("\n".join(fields).encode()).hexdigest()[:32]

    def model_key(self, model: Path, variant: Variant) -> str:
        lib = variant.path if variant.path is not None else library_dir() / "libggml.so"
        return self.key("probe", _file_id(model), variant.name, _file_id(lib))

    def illegal_key(self, variant: Variant) -> str:
        """The key of "some model died of an illegal instruction on `variant` here": the
        backend's name, this llama.cpp build and this CPU (whichever install holds the file)."""
        return self.key("illegal", variant.name)

    def get(self, key: str) -> object | None:
        try:
            return json.loads((self.folder / f"{key}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: object) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.folder / f"{key}.json", json.dumps(value).encode())
        except OSError as exc:  # a read-only cache only costs a probe next time
            logger.warning("cannot keep the llama.cpp probe result in %s: %s", self.folder, exc)


def probe(
    model: Path, variant: Variant, *, n_threads: int, timeout_s: float = PROBE_TIMEOUT_S
) -> ProbeResult:
    """Load `model` with `variant` in a child process and decode a few tokens."""
    args = ["probe", str(model), "--threads", str(n_threads)]
    if variant.path is not None:
        args += ["--variant", str(variant.path)]
    try:
        done = _run_child(args, timeout_s)
    except subprocess.TimeoutExpired:
        return ProbeResult(False, f"no result within {timeout_s:g} s")
    if done.returncode == 0:
        return ProbeResult(True, "")
    name = None
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = None
    return ProbeResult(False, f"{_status(done.returncode)}: {_tail(done.stderr)}", name)


# An illegal instruction is the CPU's verdict on a backend and is kept; any other death
# (or a timeout) may be load or a bug and is probed again next time.
_CACHED_FAILURES = frozenset({"SIGILL"})


def _extra_features(failed: Variant, candidates: Sequence[Variant]) -> list[str]:
    """The features `failed` needs that the variants ranked below it do not."""
    below = [v for v in candidates if v.score < failed.score]
    if not below:
        return list(failed.features)
    return [f for f in failed.features if f not in below[0].features]


def system_info() -> str:
    """llama.cpp's own list of the features its loaded backends were built with."""
    import llama_cpp

    raw = llama_cpp.llama_print_system_info()
    return raw.decode("utf-8", "replace").strip() if isinstance(raw, bytes) else str(raw)


class BackendLoader:
    """Chooses and loads one CPU backend per process; checks every model against it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loaded: Variant | None = None
        self._checked: set[str] = set()

    def ensure(self, model: Path, *, n_threads: int, cache_dir: Path | None = None) -> Variant:
        """Make sure `model` runs on the backend this process uses (choosing it first)."""
        cache = ProbeCache(cache_dir or default_cache_dir())
        with self._lock:
            resolved = str(model.resolve())
            if self.loaded is None:
                chosen = check_backend(model, n_threads=n_threads, cache_dir=cache.folder)
                route_llama_log()  # before ggml announces the library on stderr
                if chosen.path is not None:
                    load_variant(chosen.path)
                    built = [variant_name(f) for f in variant_files()]
                    if warning := missing_level_warning(chosen.name, built, cpu_flags()):
                        logger.warning(warning)
                init_llama()
                self.loaded = chosen
                logger.debug("llama.cpp CPU backend: %s", chosen.name)
            elif resolved not in self._checked:
                result = probe_cached(model, self.loaded, cache, n_threads)
                if not result.ok:
                    raise BackendError(
                        f"the model {model} does not run on the llama.cpp CPU backend "
                        f"'{self.loaded.name}' this process already loaded ({result.detail}); "
                        "load it in a process of its own"
                    )
            self._checked.add(resolved)
            return self.loaded


def candidates(cache: ProbeCache) -> list[Variant]:
    """The backends to try on this CPU, best first (ranked once per build and CPU)."""
    files = variant_files()
    if not files:
        return [Variant(BUILTIN, None, 1)]
    key = cache.key("rank", *map(_file_id, files))
    stored = cache.get(key)
    if isinstance(stored, list):
        ranked = [Variant(str(n), Path(p), int(sc)) for n, p, sc in stored]
    else:
        ranked = rank_variants(files)
        cache.put(key, [[v.name, str(v.path), v.score] for v in ranked])
    if not ranked:
        raise BackendError(
            f"none of llama.cpp's CPU backends ({', '.join(map(variant_name, files))}) "
            "supports this CPU"
        )
    return ranked


def probe_cached(model: Path, variant: Variant, cache: ProbeCache, n_threads: int) -> ProbeResult:
    """`probe`, remembered: successes and illegal-instruction deaths are kept on disk, and an
    illegal-instruction death also as a fact of the backend on this CPU (`choose_backend`
    skips it for every model)."""
    key = cache.model_key(model, variant)
    stored = cache.get(key)
    result: ProbeResult | None = None
    if isinstance(stored, dict):
        try:
            result = ProbeResult(**stored)
        except TypeError:
            result = None
    if result is None:
        result = probe(model, variant, n_threads=n_threads)
        if result.ok or result.signal_name in _CACHED_FAILURES:
            cache.put(key, asdict(result))
    if result.signal_name == "SIGILL" and cache.get(cache.illegal_key(variant)) is None:
        # An instruction this CPU cannot run is the backend's and the CPU's, not the model's:
        # another model may reach it too, after the process has loaded the backend.
        cache.put(cache.illegal_key(variant), {"model": str(model), "detail": result.detail})
    return result


def choose_backend(
    model: Path, ranked: Sequence[Variant], cache: ProbeCache, n_threads: int
) -> Variant:
    """The best of `ranked` that runs `model` in a probe, skipping a backend that any model died
    of an illegal instruction on here (but the last); `BackendError` naming every crash (with
    the CPU features only the crashed backend needs) when none does."""
    failures: list[str] = []
    for variant in ranked:
        crashed = cache.get(cache.illegal_key(variant))
        if isinstance(crashed, dict) and variant is not ranked[-1]:
            failures.append(
                f"the '{variant.name}' CPU backend crashed {crashed.get('model')} on this CPU "
                f"({crashed.get('detail')}), so no model uses it"
            )
            continue
        result = probe_cached(model, variant, cache, n_threads)
        if not result.ok and result.signal_name is None and result.detail.startswith("exit"):
            # The child ended itself (the file does not load): no other backend helps.
            raise BackendError(f"llama.cpp cannot run the model {model}: {result.detail}")
        if result.ok:
            if failures:
                # A fallback that works is no fault of the user's: shown with -v.
                logger.debug(
                    "llama.cpp: %s; using the '%s' CPU backend instead",
                    "; ".join(failures),
                    variant.name,
                )
            return variant
        if variant.path is None:
            failures.append(
                f"the model {model} crashed llama.cpp's CPU backend ({result.detail}); this "
                f"llama-cpp-python build was compiled for: {system_info()}. Rebuild it portably "
                "(scripts/install.sh) so that a backend without the unusable feature is chosen"
            )
        else:
            extra = _extra_features(variant, ranked)
            needs = f" (it needs {', '.join(extra)}, which this CPU reports)" if extra else ""
            failures.append(
                f"the model {model} crashed the '{variant.name}' CPU backend{needs}: "
                f"{result.detail}"
            )
    raise BackendError("; ".join(failures))


_loader = BackendLoader()


def ensure_backend(model: Path, *, n_threads: int, cache_dir: Path | None = None) -> Variant:
    """The process-wide `BackendLoader.ensure`."""
    return _loader.ensure(model, n_threads=n_threads, cache_dir=cache_dir)


def check_backend(model: Path, *, n_threads: int, cache_dir: Path | None = None) -> Variant:
    """The backend `ensure_backend` would choose for `model`, found by probing in child
    processes only (nothing is loaded here); `BackendError` when none runs it. Lets a command
    fail with the reason before it starts replicas or actors, and fills the probe cache they
    read."""
    cache = ProbeCache(cache_dir or default_cache_dir())
    return choose_backend(model, _forced(candidates(cache)), cache, n_threads)


def _forced(ranked: list[Variant]) -> list[Variant]:
    """`ranked`, or only the backend `CPU_BACKEND_ENV` names; `BackendError` when this CPU
    has no such backend."""
    name = os.environ.get(CPU_BACKEND_ENV, "").strip()
    if not name:
        return ranked
    chosen = [v for v in ranked if v.name == name]
    if not chosen:
        names = ", ".join(v.name for v in ranked)
        raise BackendError(
            f"{CPU_BACKEND_ENV}={name}: no such llama.cpp CPU backend runs on this CPU "
            f"(these do: {names})"
        )
    return chosen


def loaded_backend() -> Variant | None:
    return _loader.loaded


def load_variant(path: Path) -> None:
    """Register one CPU backend library with ggml (before `llama_backend_init`)."""
    from llama_cpp import llama_cpp as bindings

    # Through libllama's own handle: the wheel ships libggml.so and libggml.so.0 as two files,
    # and ggml loaded by path would be a second copy with a registry llama.cpp never reads.
    load = bindings._lib.ggml_backend_load
    load.argtypes = [ctypes.c_char_p]
    load.restype = ctypes.c_void_p
    if not load(str(path).encode()):
        raise BackendError(f"ggml could not load the CPU backend {path}")
