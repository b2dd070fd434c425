"""What scripts/install.sh builds of llama-cpp-python: which CPU backend variants, and no target
nothing loads.

ggml's `GGML_CPU_ALL_VARIANTS` compiles the CPU backend once per x86-64 instruction-set level
(14 of them). An install keeps few (the run-time chooser, infra/engine/cpu_builds/, picks among
whatever was built and probes it, so a level not built only costs speed on the CPUs that
needed it):

* default, for this machine: the x86-64 baseline (`x64`, so a copied venv still runs on any
  x86-64 CPU, slower and with a warning) and this CPU's best level; when that level needs AMX,
  also the best one without it (some VMs report AMX and die of its first instruction);
* `--portable`, for an image or a venv that moves between machines: the baseline and the
  levels of the machines this project runs on (AVX2; AVX-512 on Skylake-X, Ice Lake, Zen 4;
  AMX), plus this CPU's best level when that is another one.

A CPU whose features cannot be read gets the portable set; other architectures keep ggml's own
list. The levels are named ones (ggml's variants), never `-march=native`.
llama-cpp-python also builds llama.cpp's `common` library (and its HTTP and hash vendored code)
for its multimodal extension, which the install turns off: nothing loads it, and it was about a
quarter of the build's compile steps.

    python scripts/llama_build.py plan [--portable]              # the variants wanted here
    python scripts/llama_build.py patch [--portable] SOURCE_DIR  # patch an unpacked sdist
    python scripts/llama_build.py installed [--portable] VERSION # exit 0 if nothing to build

Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import importlib.util
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PORTABLE_LEVELS = ("x64", "haswell", "skylakex", "icelake", "zen4", "sapphirerapids")
GGML_CMAKELISTS = "vendor/llama.cpp/ggml/src/CMakeLists.txt"
COMMON_ON = 'set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'
VARIANT_CALL = re.compile(r"^\s*ggml_add_cpu_backend_variant\(\s*([\w.]+)((?:\s+\w+)*)\s*\)")


def _cpu_variants() -> ModuleType:
    """infra/engine/cpu_builds/cpu_variants.py, loaded by path (selfrag is not installed yet)."""
    path = ROOT / "infra" / "engine" / "cpu_builds" / "cpu_variants.py"
    spec = importlib.util.spec_from_file_location("selfrag_cpu_variants", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


cpu_variants = _cpu_variants()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def wanted(variants: dict[str, tuple[str, ...]], flags: set[str], portable: bool) -> list[str]:
    """The variants to build of those declared (`variants`: name to features, in ggml's order)
    on a CPU with cpuinfo `flags`."""
    best = cpu_variants.best_level(variants, flags)
    if portable or best is None:
        missing = [name for name in PORTABLE_LEVELS if name not in variants]
        if missing:
            raise SystemExit(f"llama.cpp's build no longer declares the variants {missing}")
        keep = set(PORTABLE_LEVELS)
    else:
        keep = {cpu_variants.BASELINE}
        if cpu_variants.AMX_FEATURES & set(variants[best]):
            keep.add(cpu_variants.best_level(variants, flags, amx=False) or cpu_variants.BASELINE)
    if best is not None:
        keep.add(best)
    return [name for name in variants if name in keep]


def x86_variants(cmakelists: str) -> dict[str, tuple[str, ...]]:
    """The x86 variants ggml's CMakeLists declares, in its order, with the features each needs."""
    found: dict[str, tuple[str, ...]] = {}
    in_x86 = False
    for line in cmakelists.splitlines():
        if "GGML_SYSTEM_ARCH STREQUAL" in line:
            in_x86 = '"x86"' in line
        elif in_x86 and (m := VARIANT_CALL.match(line)):
            found[m.group(1)] = tuple(m.group(2).split())
    return found


def patch_variants(path: Path, flags: set[str], portable: bool) -> list[str]:
    """Comment out the x86 variants not wanted; returns those kept (empty: file left alone)."""
    text = path.read_text()
    declared = x86_variants(text)
    if not is_x86() or not declared:
        return []
    keep = wanted(declared, flags, portable)
    lines = []
    for line in text.splitlines(keepends=True):
        m = VARIANT_CALL.match(line)
        if m and m.group(1) in declared and m.group(1) not in keep:
            line = "# selfrag: not built # " + line
        lines.append(line)
    path.write_text("".join(lines))
    return keep


def patch_common(path: Path) -> None:
    """Stop llama-cpp-python's CMakeLists from forcing llama.cpp's `common` library on."""
    text = path.read_text()
    if COMMON_ON not in text:
        raise SystemExit(f"{path} no longer forces LLAMA_BUILD_COMMON on as expected")
    path.write_text(text.replace(COMMON_ON, COMMON_ON.replace(" ON ", " OFF ")))


def installed_variants() -> set[str] | None:
    """The CPU variants of the installed llama-cpp-python (None: not installed)."""
    try:
        dist = metadata.distribution("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return None
    return {
        f.name.removeprefix("libggml-cpu-").removesuffix(".so")
        for f in dist.files or ()
        if f.name.startswith("libggml-cpu-") and f.name.endswith(".so")
    }


def build_needed(version: str, flags: set[str], portable: bool) -> bool:
    """Whether the installed llama-cpp-python lacks `version` or a variant wanted here (a
    portable build holds every one a default install wants)."""
    have = installed_variants()
    if have is None or metadata.version("llama_cpp_python") != version or not have:
        return True
    if not is_x86():
        return False
    return not set(wanted(cpu_variants.VARIANT_FEATURES, flags, portable)) <= have


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if a != "--portable"]
    portable = len(args) < len(argv) - 1
    if len(args) not in (1, 2) or args[0] not in ("plan", "patch", "installed"):
        print(__doc__, file=sys.stderr)
        return 2
    flags = cpu_variants.cpu_flags()
    if args[0] == "plan":
        names = wanted(cpu_variants.VARIANT_FEATURES, flags, portable) if is_x86() else []
        print(" ".join(names) if names else "all")
        return 0
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if args[0] == "installed":
        return 1 if build_needed(args[1], flags, portable) else 0
    source = Path(args[1])
    patch_common(source / "CMakeLists.txt")
    names = patch_variants(source / GGML_CMAKELISTS, flags, portable)
    print(" ".join(names) if names else "all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
