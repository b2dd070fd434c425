"""The CPU backend variants a llama.cpp build ships (`libggml-cpu-<name>.so`): where they are,
their names, the instruction sets each is compiled for, and which of them this CPU can run.

Standard library only: `scripts/llama_build.py` loads this file by path to choose the variants
an install builds, before anything else is installed."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

# The environment variable that limits a process to one variant (`llama_cpu_builds`), not a
# setting: the backend is chosen per process, its probes in children that inherit it.
CPU_BACKEND_ENV = "SELFRAG_CPU_BACKEND"
# The instruction sets each variant of `GGML_CPU_ALL_VARIANTS` is compiled for
# (ggml/src/CMakeLists.txt); used to name what a failing variant needs beyond the next one.
VARIANT_FEATURES: dict[str, tuple[str, ...]] = {
    "x64": (),
    "sse42": ("SSE42",),
    "sandybridge": ("SSE42", "AVX"),
    "ivybridge": ("SSE42", "AVX", "F16C"),
    "piledriver": ("SSE42", "AVX", "F16C", "FMA"),
    "haswell": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
    "skylakex": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512"),
    "cannonlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI"),
    "cascadelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI"),
    "icelake": (
        *("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
        *("AVX512", "AVX512_VBMI", "AVX512_VNNI"),
    ),
    "cooperlake": (
        *("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
        *("AVX512", "AVX512_VNNI", "AVX512_BF16"),
    ),
    "zen4": (
        *("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
        *("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"),
    ),
    "alderlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI"),
    "sapphirerapids": (
        *("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
        *("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8"),
    ),
}


BASELINE = "x64"
"""The variant every x86-64 CPU runs (no instruction set beyond x86-64's own)."""

# ggml's feature names (the arguments of ggml_add_cpu_backend_variant) as Linux's cpuinfo flags.
CPUINFO_FLAGS: dict[str, tuple[str, ...]] = {
    "SSE42": ("sse4_2",),
    "AVX": ("avx",),
    "F16C": ("f16c",),
    "FMA": ("fma",),
    "AVX2": ("avx2",),
    "BMI2": ("bmi2",),
    "AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "AVX512_VBMI": ("avx512vbmi",),
    "AVX512_VNNI": ("avx512_vnni",),
    "AVX512_BF16": ("avx512_bf16",),
    "AVX_VNNI": ("avx_vnni",),
    "AMX_TILE": ("amx_tile",),
    "AMX_INT8": ("amx_int8",),
}
AMX_FEATURES = frozenset({"AMX_TILE", "AMX_INT8"})
"""Reported by some VMs whose CPU cannot run them (the first AMX instruction is SIGILL)."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """This CPU's feature flags as Linux reports them (empty when unknown)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def runs_on(features: tuple[str, ...], flags: set[str]) -> bool:
    """Whether a CPU with cpuinfo `flags` has every one of ggml's `features`."""
    return all(flag in flags for feature in features for flag in CPUINFO_FLAGS.get(feature, ()))


def best_level(
    variants: dict[str, tuple[str, ...]], flags: set[str], *, amx: bool = True
) -> str | None:
    """The variant of `variants` (name: features) with the most features that a CPU with
    cpuinfo `flags` has all of; without `amx`, the best one that needs no AMX. None when the
    flags are unknown or none runs."""
    if not flags:
        return None
    runnable = [
        name
        for name, features in variants.items()
        if runs_on(features, flags) and (amx or not AMX_FEATURES & set(features))
    ]
    return max(runnable, key=lambda name: len(variants[name]), default=None)


class BackendError(RuntimeError):
    """No CPU backend of this llama.cpp build can run the model on this CPU."""


@dataclass(frozen=True)
class Variant:
    """One CPU backend library: its name (`haswell`, or `built-in`), file and ggml score."""

    name: str
    path: Path | None
    score: int

    @property
    def features(self) -> tuple[str, ...]:
        return VARIANT_FEATURES.get(self.name, ())


def missing_level_warning(chosen: str, built: list[str], flags: set[str]) -> str | None:
    """What to tell a process that runs on the x86-64 baseline (`chosen`) where this CPU (cpuinfo
    `flags`) has a better level that the build (`built`, its variant names) lacks, as a venv
    built on another machine does; None otherwise."""
    if chosen != BASELINE:
        return None
    better = best_level(VARIANT_FEATURES, flags, amx=False)
    if better is None or better == BASELINE or better in built:
        return None
    return (
        "llama.cpp runs on its x86-64 baseline CPU backend here, much slower than this CPU "
        f"allows: this llama-cpp-python build has no backend for its level '{better}' (it has "
        f"{', '.join(sorted(built))}: it was built on another machine). `bash "
        "scripts/install.sh` on this machine builds one; `--portable` builds the levels of "
        "most machines, for a venv that moves"
    )


def library_dir() -> Path:
    """The folder of llama-cpp-python's shared libraries (found without importing it)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise BackendError("llama-cpp-python is not installed (scripts/install.sh builds it)")
    return Path(spec.origin).resolve().parent / "lib"


def variant_files() -> list[Path]:
    """The CPU backend variant libraries of the installed build (empty for a built-in backend).

    ggml installs them into the wheel's `bin/` (its `CMAKE_INSTALL_BINDIR`), beside the
    `llama_cpp` package; a build may also put them next to `libllama.so`.
    """
    lib = library_dir()
    found: dict[str, Path] = {}
    for folder in (lib, lib.parent.parent / "bin"):
        for path in sorted(folder.glob("libggml-cpu-*.so")):
            found.setdefault(path.name, path)
    return list(found.values())


def variant_name(path: Path) -> str:
    return path.name.removeprefix("libggml-cpu-").removesuffix(".so")


def expected_features(flags: set[str] | None = None) -> tuple[str, ...]:
    """The instruction sets of the variant a process on this CPU (cpuinfo `flags`, default this
    one's) is expected to load, known without loading or probing anything: the one
    `CPU_BACKEND_ENV` names, else the best built variant it runs that needs no AMX (a probe may
    still fall to a lower one). Empty for a build with one built-in backend, or an unknown CPU."""
    forced = os.environ.get(CPU_BACKEND_ENV, "").strip()
    if forced:
        return VARIANT_FEATURES.get(forced, ())
    try:
        built = {variant_name(path) for path in variant_files()}
    except BackendError:
        return ()
    mine = {name: features for name, features in VARIANT_FEATURES.items() if name in built}
    best = best_level(mine, cpu_flags() if flags is None else flags, amx=False)
    return VARIANT_FEATURES[best] if best is not None else ()
