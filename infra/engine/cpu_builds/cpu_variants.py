"""The CPU backend variants a portable llama.cpp build ships (`libggml-cpu-<name>.so`): where
they are, their names and the instruction sets each is compiled for."""

from __future__ import annotations

import importlib.util
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
