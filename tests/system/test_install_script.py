"""scripts/install.sh and what it builds of llama-cpp-python (scripts/llama_build.py): this
CPU's best level and the x86-64 baseline by default, six levels with --portable, no llama.cpp
`common` library, and the flags in any order. The build itself is not run here (minutes of
both cores): docs/install.md has its measured time."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from selfrag.infra.engine.cpu_builds.cpu_variants import VARIANT_FEATURES
from tests.paths import ROOT

ZEN3 = {"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2"}
ZEN4 = ZEN3 | {
    *("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    *("avx512vbmi", "avx512_vnni", "avx512_bf16"),
}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_int8"}
# ggml's declarations, as in vendor/llama.cpp/ggml/src/CMakeLists.txt of the pinned version.
GGML_CMAKELISTS = (
    'if (GGML_SYSTEM_ARCH STREQUAL "x86")\n'
    + "".join(
        f"        ggml_add_cpu_backend_variant({name}{''.join(' ' + f for f in features)})\n"
        for name, features in VARIANT_FEATURES.items()
    )
    + 'elseif (GGML_SYSTEM_ARCH STREQUAL "ARM")\n'
    + "        ggml_add_cpu_backend_variant(armv8.0_1)\n"
    + "endif()\n"
)


@pytest.fixture(scope="module")
def llama_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llama_build", ROOT / "scripts/llama_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (ZEN3, ["x64", "haswell"]),
        (ZEN4, ["x64", "zen4"]),
        # AMX reported: its level, and the best without it (a VM that traps on AMX falls back).
        (SAPPHIRE_RAPIDS, ["x64", "zen4", "sapphirerapids"]),
        (set(), ["x64", "haswell", "skylakex", "icelake", "zen4", "sapphirerapids"]),
    ],
)
def test_a_default_build_is_this_cpus_best_level_and_the_baseline(
    llama_build: ModuleType, flags: set[str], expected: list[str]
) -> None:
    # An unknown CPU (no cpuinfo flags) gets the portable set.
    assert llama_build.wanted(VARIANT_FEATURES, flags, portable=False) == expected


def test_a_portable_build_keeps_six_levels_and_this_cpus_best(llama_build: ModuleType) -> None:
    six = ["x64", "haswell", "skylakex", "icelake", "zen4", "sapphirerapids"]
    assert llama_build.wanted(VARIANT_FEATURES, ZEN4, portable=True) == six
    cascade_lake = ZEN3 | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
    cascade_lake |= {"avx512_vnni"}
    assert "cascadelake" in llama_build.wanted(VARIANT_FEATURES, cascade_lake, portable=True)


def test_the_sdist_is_patched_to_build_the_wanted_variants_and_no_common_library(
    llama_build: ModuleType, tmp_path: Path
) -> None:
    ggml = tmp_path / "CMakeLists.txt"
    ggml.write_text(GGML_CMAKELISTS)
    assert llama_build.patch_variants(ggml, ZEN4, portable=False) == ["x64", "zen4"]
    text = ggml.read_text()
    built = [line for line in text.splitlines() if line.startswith("        ggml_add_cpu")]
    assert built == [
        "        ggml_add_cpu_backend_variant(x64)",
        "        ggml_add_cpu_backend_variant(zen4 " + " ".join(VARIANT_FEATURES["zen4"]) + ")",
        "        ggml_add_cpu_backend_variant(armv8.0_1)",  # another architecture: untouched
    ]
    top = tmp_path / "top.txt"
    top.write_text(f"option(LLAVA_BUILD)\n    {llama_build.COMMON_ON}\n")
    llama_build.patch_common(top)
    assert "LLAMA_BUILD_COMMON OFF CACHE BOOL" in top.read_text()
    with pytest.raises(SystemExit, match="LLAMA_BUILD_COMMON"):
        llama_build.patch_common(top)  # a new llama-cpp-python that no longer forces it: said


def test_a_portable_build_satisfies_a_default_install_and_not_the_reverse(
    llama_build: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama_build.metadata, "version", lambda _: "0.3.36")
    monkeypatch.setattr(llama_build, "is_x86", lambda: True)
    portable = {"x64", "haswell", "skylakex", "icelake", "zen4", "sapphirerapids"}
    monkeypatch.setattr(llama_build, "installed_variants", lambda: portable)
    assert not llama_build.build_needed("0.3.36", ZEN4, portable=False)
    assert not llama_build.build_needed("0.3.36", ZEN4, portable=True)
    assert llama_build.build_needed("0.3.37", ZEN4, portable=False)  # another version
    monkeypatch.setattr(llama_build, "installed_variants", lambda: {"x64", "zen4"})
    assert not llama_build.build_needed("0.3.36", ZEN4, portable=False)
    assert llama_build.build_needed("0.3.36", ZEN4, portable=True)
    assert llama_build.build_needed("0.3.36", ZEN3, portable=False)  # a venv copied to Zen 3
    monkeypatch.setattr(llama_build, "installed_variants", lambda: None)
    assert llama_build.build_needed("0.3.36", ZEN4, portable=False)


def _install(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts/install.sh"), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        check=False,
    )


def test_install_flags_combine_in_any_order() -> None:
    for args in (("--dev", "--portable"), ("--portable", "--dev")):
        done = _install(*args, "--plan")
        assert done.returncode == 0, done.stderr
        assert "extras: [test,docs]" in done.stdout
        assert "portable build" in done.stdout
    done = _install("--plan")
    assert done.returncode == 0, done.stderr
    assert "extras: none" in done.stdout and "this-cpu-and-baseline build" in done.stdout
    levels = done.stdout.rstrip().split("CPU backends: ")[1].split()
    assert levels == ["all"] or levels[0] == "x64"  # the baseline on x86-64


def test_an_unknown_install_flag_is_refused() -> None:
    done = _install("--dev", "--fast")
    assert done.returncode == 2
    assert "usage:" in done.stderr and "--portable" in done.stderr


def test_the_install_prints_each_phases_time_at_its_end(tmp_path: Path) -> None:
    # A copy of the script and the project file, over a venv whose python installs nothing
    # (pip and the model presets succeed at once) and finds llama-cpp-python built already:
    # every phase runs, in seconds, and the summary is what is looked at.
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "install.sh").write_text((ROOT / "scripts/install.sh").read_text())
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/bin/bash\n"
        'case "$1" in\n'
        "    -m | scripts/llama_build.py) exit 0 ;;\n"
        f'    *) exec {sys.executable} "$@" ;;\n'
        "esac\n"
    )
    python.chmod(0o755)
    done = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "install.sh")],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary = done.stderr.split("install.sh: done in ")[1].splitlines()
    assert summary[0].endswith(" s:")
    phases = [line.split(" s  ", 1) for line in summary[1:]]
    assert all(seconds.strip().isdigit() for seconds, _ in phases)
    assert sorted(what for _, what in phases) == sorted(
        [
            "virtual environment and pip",
            "dependencies, selfrag and model packages (pip, alongside the build)",
            "llama-cpp-python: installed already",
            "waiting for the dependencies after llama-cpp-python",
            "llama-cpp-python installed, model files checked",
        ]
    )
