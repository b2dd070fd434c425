"""Choose and keep the CPU backend variants llama-cpp-python's build compiles (scripts/install.sh).

ggml's `GGML_CPU_ALL_VARIANTS` compiles the CPU backend once per instruction-set level: 14 on
x86-64, about 21 of a first install's 28 minutes on 2 cores. Most of them only matter on one
generation of desktop CPUs. This keeps, on x86-64, the baseline and the levels of the machines
this project runs on (AVX2; AVX-512 on Intel, Ice Lake, Zen 4; AMX), plus the best level this
CPU supports when that is another one; other architectures keep ggml's own list. The run-time
chooser (infra/engine/cpu_builds/llama_cpu_builds.py) picks among whatever was built and probes
it, so a level that was not built only costs speed on the CPUs that needed it.

    python scripts/llama_variants.py list CMAKELISTS     # the variants kept, one line
    python scripts/llama_variants.py patch CMAKELISTS    # drop the others from the file

Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import platform
import re
import sys
from pathlib import Path

X86_KEPT = ("x64", "haswell", "skylakex", "icelake", "zen4", "sapphirerapids")

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

VARIANT_CALL = re.compile(r"^\s*ggml_add_cpu_backend_variant\(\s*([\w.]+)((?:\s+\w+)*)\s*\)")


def x86_variants(cmakelists: str) -> dict[str, tuple[str, ...]]:
    """The x86 variants the file declares, in its order, with the features each needs."""
    found: dict[str, tuple[str, ...]] = {}
    in_x86 = False
    for line in cmakelists.splitlines():
        if "GGML_SYSTEM_ARCH STREQUAL" in line:
            in_x86 = '"x86"' in line
        elif in_x86 and (m := VARIANT_CALL.match(line)):
            found[m.group(1)] = tuple(m.group(2).split())
    return found


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def best_for_this_cpu(variants: dict[str, tuple[str, ...]], flags: set[str]) -> str | None:
    """The variant with the most features that this CPU has all of (None if flags unknown)."""
    if not flags:
        return None
    runnable = [
        name
        for name, features in variants.items()
        if all(flag in flags for feature in features for flag in CPUINFO_FLAGS.get(feature, ()))
    ]
    return max(runnable, key=lambda name: len(variants[name]), default=None)


def kept(cmakelists: str) -> list[str]:
    variants = x86_variants(cmakelists)
    if platform.machine().lower() not in ("x86_64", "amd64") or not variants:
        return []
    missing = [name for name in X86_KEPT if name not in variants]
    if missing:
        raise SystemExit(f"llama.cpp's build no longer declares the variants {missing}")
    keep = set(X86_KEPT)
    if (best := best_for_this_cpu(variants, cpu_flags())) is not None:
        keep.add(best)
    return [name for name in variants if name in keep]


def patch(path: Path) -> list[str]:
    """Comment out the x86 variants not kept; returns those kept (empty: file left alone)."""
    text = path.read_text()
    keep = kept(text)
    if not keep:
        return []
    declared = x86_variants(text)
    lines = []
    for line in text.splitlines(keepends=True):
        m = VARIANT_CALL.match(line)
        if m and m.group(1) in declared and m.group(1) not in keep:
            line = "# selfrag: not built # " + line
        lines.append(line)
    path.write_text("".join(lines))
    return keep


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("list", "patch"):
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[2])
    names = patch(path) if argv[1] == "patch" else kept(path.read_text())
    print(" ".join(names) if names else "all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
