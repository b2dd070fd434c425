"""Choosing llama.cpp's CPU backend: ranking, the crash probe, its cache and its messages.

The real tests run the installed portable build and the shipped quantized (Q4_1) SmolLM2 file,
the weights that died with SIGILL in ggml's AMX kernel on an AVX-512/AMX Xeon VM. A backend
that crashes is simulated with a library that ggml loads like a CPU variant and whose
`ggml_backend_init` executes an illegal instruction, so the probe sees a real SIGILL.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from selfrag.infra.engine.cpu_builds.cpu_variants import (
    CPU_BACKEND_ENV,
    VARIANT_FEATURES,
    BackendError,
    Variant,
    best_level,
    cpu_flags,
    expected_features,
    missing_level_warning,
    variant_files,
)
from selfrag.infra.engine.cpu_builds.llama_cpu_builds import (
    BUILTIN,
    ProbeCache,
    ProbeResult,
    candidates,
    choose_backend,
    loaded_backend,
    probe,
    probe_cached,
)
from selfrag.infra.models.model_files import default_model_path, derive_weights
from tests.paths import ROOT
from tests.real import real

REPO = ROOT
ILLEGAL_INSTRUCTION_BACKEND = r"""
int ggml_backend_score(void) { return 1 << 20; }
void * ggml_backend_init(void) { __builtin_trap(); return 0; }
"""


@pytest.fixture
def cache(tmp_path: Path) -> ProbeCache:
    return ProbeCache(tmp_path / "probes")


def _library(folder: Path, name: str) -> Path:
    path = folder / f"libggml-cpu-{name}.so"
    path.write_bytes(b"not loaded: its probe result is already cached")
    return path


def test_a_crashed_backend_falls_back_and_names_the_feature(
    tmp_path: Path, cache: ProbeCache, caplog: pytest.LogCaptureFixture
) -> None:
    model = tmp_path / "model.Q4_K_M.gguf"
    model.write_bytes(b"GGUF")
    amx = Variant("sapphirerapids", _library(tmp_path, "sapphirerapids"), 4000)
    avx512 = Variant("icelake", _library(tmp_path, "icelake"), 2000)
    cache.put(
        cache.model_key(model, amx),
        asdict(ProbeResult(False, "killed by SIGILL: no output", "SIGILL")),
    )
    cache.put(cache.model_key(model, avx512), asdict(ProbeResult(True, "")))
    # A working fallback is a DEBUG record (shown with -v).
    with caplog.at_level(logging.DEBUG, logger="selfrag.infra.engine.cpu_builds.llama_cpu_builds"):
        chosen = choose_backend(model, [amx, avx512], cache, n_threads=1)
    assert chosen == avx512
    message = caplog.text
    assert str(model) in message and "SIGILL" in message
    # What sapphirerapids needs beyond icelake: the AMX features, not all of AVX-512.
    assert "AMX_TILE, AMX_INT8" in message and "AVX512_VBMI" not in message


def test_a_backend_another_model_died_on_is_skipped_for_every_model(
    tmp_path: Path, cache: ProbeCache, caplog: pytest.LogCaptureFixture
) -> None:
    # A backend whose instructions this CPU cannot run is skipped even for a model it ran: a
    # process choosing it for that model could not load the other one afterwards.
    crashed, survived = tmp_path / "a.Q4_K_M.gguf", tmp_path / "b.F16.gguf"
    for m in (crashed, survived):
        m.write_bytes(b"GGUF")
    amx = Variant("sapphirerapids", _library(tmp_path, "sapphirerapids"), 4000)
    avx512 = Variant("icelake", _library(tmp_path, "icelake"), 2000)
    sigill = asdict(ProbeResult(False, "killed by SIGILL: no output", "SIGILL"))
    cache.put(cache.model_key(crashed, amx), sigill)
    for m in (crashed, survived):
        cache.put(cache.model_key(m, avx512), asdict(ProbeResult(True, "")))
    cache.put(cache.model_key(survived, amx), asdict(ProbeResult(True, "")))
    assert choose_backend(survived, [amx, avx512], cache, n_threads=1) == amx  # nothing known
    assert choose_backend(crashed, [amx, avx512], cache, n_threads=1) == avx512
    assert cache.get(cache.illegal_key(amx))["model"] == str(crashed)
    with caplog.at_level(logging.DEBUG, logger="selfrag.infra.engine.cpu_builds.llama_cpu_builds"):
        assert choose_backend(survived, [amx, avx512], cache, n_threads=1) == avx512
    assert f"crashed {crashed} on this CPU" in caplog.text


def test_no_backend_that_runs_is_a_clear_error(tmp_path: Path, cache: ProbeCache) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    only = Variant("haswell", _library(tmp_path, "haswell"), 60)
    cache.put(
        cache.model_key(model, only), asdict(ProbeResult(False, "killed by SIGILL", "SIGILL"))
    )
    with pytest.raises(BackendError) as err:
        choose_backend(model, [only], cache, n_threads=1)
    text = str(err.value)
    assert str(model) in text and "'haswell'" in text and "AVX2" in text and "SIGILL" in text


def test_probe_results_are_keyed_by_model_file(tmp_path: Path, cache: ProbeCache) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    variant = Variant("haswell", _library(tmp_path, "haswell"), 60)
    key = cache.model_key(model, variant)
    assert cache.get(key) is None
    cache.put(key, asdict(ProbeResult(True, "")))
    assert cache.get(key) == {"ok": True, "detail": "", "signal_name": None}
    # A replaced model file (new size) is a new key: it is probed again.
    model.write_bytes(b"GGUF and more")
    assert cache.model_key(model, variant) != key


AVX2_FLAGS = {"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2"}
AMX_FLAGS = AVX2_FLAGS | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
AMX_FLAGS |= {"avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"}


def test_the_baseline_warns_where_the_build_lacks_this_cpus_level() -> None:
    # A venv built on a Zen 4 (x64 and zen4) copied to an AVX2 machine: zen4 cannot load there,
    # so the baseline runs, and the message says which level is missing and how to build it.
    warning = missing_level_warning("x64", ["x64", "zen4"], AVX2_FLAGS)
    assert warning is not None
    assert "'haswell'" in warning and "x64, zen4" in warning and "scripts/install.sh" in warning
    # No warning where nothing better could run, or the level is built (then it was chosen, or
    # it crashed, which the probe reports), or a better level than the baseline was chosen.
    assert missing_level_warning("x64", ["x64", "zen4"], {"fpu", "sse2"}) is None
    assert missing_level_warning("x64", ["x64", "haswell"], AVX2_FLAGS) is None
    assert missing_level_warning("haswell", ["x64", "haswell"], AVX2_FLAGS | {"avx512f"}) is None
    assert missing_level_warning("x64", ["x64"], set()) is None  # flags unknown


def test_the_best_level_follows_cpuinfo_flags(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu " + " ".join(sorted(AVX2_FLAGS)) + "\n")
    assert cpu_flags(cpuinfo) == {"fpu", *AVX2_FLAGS}
    assert best_level(VARIANT_FEATURES, cpu_flags(cpuinfo)) == "haswell"
    assert cpu_flags(tmp_path / "absent") == set()
    assert best_level(VARIANT_FEATURES, AMX_FLAGS) == "sapphirerapids"
    assert best_level(VARIANT_FEATURES, AMX_FLAGS, amx=False) == "zen4"


def test_the_expected_backend_is_the_best_built_one_without_amx_or_the_forced_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import selfrag.infra.engine.cpu_builds.cpu_variants as variants

    built = ["x64", "haswell", "zen4", "sapphirerapids"]
    monkeypatch.setattr(
        variants, "variant_files", lambda: [Path(f"libggml-cpu-{n}.so") for n in built]
    )
    monkeypatch.delenv(CPU_BACKEND_ENV, raising=False)
    assert expected_features(AMX_FLAGS) == VARIANT_FEATURES["zen4"]  # AMX may trap: not expected
    assert expected_features(AVX2_FLAGS) == VARIANT_FEATURES["haswell"]
    assert expected_features(set()) == ()  # flags unknown
    built[:] = ["x64", "haswell"]
    assert expected_features(AMX_FLAGS) == VARIANT_FEATURES["haswell"]  # the build lacks zen4
    monkeypatch.setenv(CPU_BACKEND_ENV, "x64")
    assert expected_features(AMX_FLAGS) == ()
    monkeypatch.delenv(CPU_BACKEND_ENV)

    def no_build() -> list[Path]:
        raise BackendError("llama-cpp-python is not installed")

    monkeypatch.setattr(variants, "variant_files", no_build)
    assert expected_features(AMX_FLAGS) == ()


# --- the real build ------------------------------------------------------------------------------


def test_the_installed_build_ships_ranked_cpu_variants(cache: ProbeCache) -> None:
    files = variant_files()
    assert files, "llama-cpp-python is not the portable build (run scripts/install.sh)"
    ranked = candidates(cache)
    names = [v.name for v in ranked]
    assert set(names) <= set(VARIANT_FEATURES)
    assert "x64" in names  # the baseline runs on every x86-64 CPU
    assert [v.score for v in ranked] == sorted((v.score for v in ranked), reverse=True)
    assert all(v.score > 0 for v in ranked)
    # Ranked once per build and CPU: the second call reads the cache.
    assert candidates(cache) == ranked


@pytest.fixture(scope="module")
@real
def f16_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return derive_weights(default_model_path(), "f16", tmp_path_factory.mktemp("home"))


@pytest.mark.parametrize("weights", ["original", "f16"])
def test_the_model_passes_the_probe_with_the_best_backend(
    llama_model: Path, weights: str, cache: ProbeCache, request: pytest.FixtureRequest
) -> None:
    # The shipped Q4_1 file and the derived F16 copy (weights="auto"), each in a fresh child.
    model = (
        default_model_path() if weights == "original" else request.getfixturevalue("f16_weights")
    )
    # The best backend that runs it here (an AMX build dies on some VMs that report AMX).
    best = choose_backend(model, candidates(cache), cache, n_threads=1)
    result = probe_cached(model, best, cache, n_threads=1)
    assert result.ok, result.detail
    assert cache.get(cache.model_key(model, best)) == asdict(result)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the crashing backend")
def test_a_backend_dying_of_sigill_is_skipped_for_the_next(
    llama_model: Path, tmp_path: Path, cache: ProbeCache, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "crash.c"
    source.write_text(ILLEGAL_INSTRUCTION_BACKEND)
    library = tmp_path / "libggml-cpu-sapphirerapids.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    model = default_model_path()
    crashing = Variant("sapphirerapids", library, 1 << 20)
    result = probe(model, crashing, n_threads=1)
    assert not result.ok and result.signal_name == "SIGILL", result
    # The real builds below the fake AMX one (the real AMX build is left out: it is the same
    # level, so nothing would be only the fake one's to name).
    real = [v for v in candidates(cache) if v.name != crashing.name]
    usable = next(v for v in real if probe_cached(model, v, cache, n_threads=1).ok)
    # A working fallback is a DEBUG record (shown with -v).
    with caplog.at_level(logging.DEBUG, logger="selfrag.infra.engine.cpu_builds.llama_cpu_builds"):
        chosen = choose_backend(model, [crashing, *real], cache, n_threads=1)
    assert chosen == usable
    assert "crashed the 'sapphirerapids' CPU backend" in caplog.text
    assert "AMX_INT8" in caplog.text and "SIGILL" in caplog.text
    # The illegal instruction is remembered: the next process does not crash again.
    assert cache.get(cache.model_key(model, crashing))["signal_name"] == "SIGILL"


def test_engine_process_uses_a_probed_variant(llama_model: Path) -> None:
    from selfrag.infra.engine.llama_engine import LlamaEngine

    with LlamaEngine(
        default_model_path(), n_ctx=512, n_seq_max=1, n_threads=1, n_batch=64, model_id="q4"
    ) as engine:
        assert engine.detokenize(engine.tokenize("Normandy")) == "Normandy"
    loaded = loaded_backend()
    assert loaded is not None and loaded.name != BUILTIN


def test_cli_answers_on_the_original_quantized_weights(indexed_home: Path) -> None:
    """`SELFRAG_MODEL__WEIGHTS=original selfrag ask …` exited 132 (SIGILL) on an AMX VM."""
    env = {**os.environ, "SELFRAG_MODEL__WEIGHTS": "original", "SELFRAG_MODEL__N_THREADS": "1"}
    done = subprocess.run(
        [
            *(sys.executable, "-m", "selfrag.cli", "--home", str(indexed_home)),
            *("ask", "Who founded Normandy?", "--json", "--mode", "always"),
            *("--top-k", "2", "--max-segments", "1"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"answer"' in done.stdout


def test_serve_stops_before_ray_when_llama_cpp_cannot_load_the_model(
    llama_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from selfrag.cli import main

    # A well-formed GGUF header with no metadata and no tensors: no architecture to load.
    model = tmp_path / "empty.gguf"
    model.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))
    monkeypatch.setenv("SELFRAG_MODEL__PATH", str(model))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = main(["--home", str(tmp_path / "home"), "serve", "--port", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"llama.cpp cannot run the model {model}" in err and "Traceback" not in err


def test_the_environment_can_force_one_backend(
    tmp_path: Path, cache: ProbeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI lands on AVX2-only machines too: a run on another machine forces their backend
    (`SELFRAG_CPU_BACKEND=haswell`) to see what they compute."""
    from selfrag.infra import settings_loader
    from selfrag.infra.engine.cpu_builds import llama_cpu_builds
    from selfrag.infra.engine.cpu_builds.cpu_variants import CPU_BACKEND_ENV
    from selfrag.infra.engine.cpu_builds.llama_cpu_builds import check_backend
    from selfrag.infra.settings_loader import load_settings

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    ranked = [Variant(n, _library(tmp_path, n), s) for n, s in (("zen4", 90), ("haswell", 60))]
    for variant in ranked:
        cache.put(cache.model_key(model, variant), asdict(ProbeResult(True, "")))
    monkeypatch.setattr(llama_cpu_builds, "candidates", lambda _: ranked)
    assert check_backend(model, n_threads=1, cache_dir=cache.folder).name == "zen4"
    monkeypatch.setenv(CPU_BACKEND_ENV, "haswell")
    assert check_backend(model, n_threads=1, cache_dir=cache.folder).name == "haswell"
    monkeypatch.setenv(CPU_BACKEND_ENV, "icelake")
    with pytest.raises(BackendError, match=r"SELFRAG_CPU_BACKEND=icelake.*zen4, haswell"):
        check_backend(model, n_threads=1, cache_dir=cache.folder)
    # Not a setting: the settings neither refuse nor report it, under the name the engine reads.
    load_settings(environ={CPU_BACKEND_ENV: "haswell", "SELFRAG_HOME": str(tmp_path)})
    assert settings_loader.CPU_BACKEND_ENV == CPU_BACKEND_ENV
