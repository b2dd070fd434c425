"""tests/ mirrors the package: a test file sits in the folder of tests/ that mirrors the package
folder it tests (tests/system/ holds the tests of the whole system, and tests/ itself only the
tests of the package's root modules), and each public module has a direct test,
`tests/<folder>/test_<module>.py` or `test_<module>_<what>.py`, unless it is listed below."""

from __future__ import annotations

import os
from pathlib import Path

from tests.paths import ROOT

TESTS = ROOT / "tests"
# Top-level folders that are not the package.
NOT_PACKAGE = {"tests", "bench", "scripts", "docs", "deploy"}
# Folders of tests/ that mirror no package folder, and why.
TEST_ONLY_FOLDERS = {
    "system": "the whole system: end to end runs, the repository's shape, docs and packaging",
}
NOT_MODULES = {"__init__", "__main__"}

# Public modules without a test file of their own whose behaviour the named test file checks
# on purpose (a part of a subsystem tested through its front, or a command through the job it
# runs); a module may leave this list for a test of its own at any time.
_DOCUMENTS = "tests/infra/store/test_qdrant_documents.py"
_BATCH = "tests/jobs/batch/test_batch_driver.py"
_EVAL = "tests/jobs/evaluation/test_eval_runner.py"
_LLAMA = "tests/infra/engine/test_llama_engine.py"
_CPU_BUILDS = "tests/infra/engine/cpu_builds/test_llama_cpu_builds.py"
_QDRANT = "tests/infra/store/test_qdrant_store.py"
_ADAPTERS = "tests/integrations/test_integrations.py"
COVERED_ELSEWHERE: dict[str, str] = {
    # parts split out of a module to keep it under 400 lines: tested with the module they
    # came from
    "actors/http/deployment_calls": "tests/actors/http/test_service.py",
    "actors/http/metric_specs": "tests/actors/http/test_metrics.py",
    "actors/http/openai_requests": "tests/actors/http/test_openai_routes.py",
    "actors/http/request_edge": "tests/actors/http/test_guards.py",
    "cli/versions": "tests/cli/test_status.py",
    "infra/cache/sealed_values": "tests/infra/cache/test_answer_cache.py",
    "infra/corpus/bounded_reads": "tests/infra/corpus/test_reading.py",
    "infra/corpus/splitting": "tests/infra/store/test_qdrant_documents.py",
    "infra/engine/cpu_builds/cpu_variants": _CPU_BUILDS,
    "infra/engine/llama_calls": _LLAMA,
    "infra/models/gguf_header": "tests/infra/models/test_model_files.py",
    "infra/models/model_listing": "tests/infra/models/test_model_presets.py",
    "infra/store/qdrant_migration": "tests/infra/store/test_qdrant_store.py",
    "infra/store/store_holder": "tests/infra/store/test_qdrant_store.py",
    "schemas/openai_responses": "tests/actors/http/test_openai_routes.py",
    # the HTTP app: the documents routes with the documents, the OpenAI format and SSE stream
    # through the routes that use them
    "actors/http/documents_routes": _DOCUMENTS,
    "actors/http/openai_format": "tests/actors/http/test_openai_routes.py",
    "actors/http/streaming": "tests/actors/http/test_routes.py",
    "actors/deployments": "tests/actors/test_serve_app.py",
    "ray_app": "tests/actors/test_serve_app_config.py",
    # the CLI's commands, where the feature they drive is tested
    "cli/common": "tests/infra/models/test_model_presets.py",
    "cli/docs": _DOCUMENTS,
    "cli/jobs": _BATCH,
    "cli/parser": "tests/cli/test_bad_input.py",
    # infra: parts of the engine, the store and the caches, tested through their front
    "infra/cache/tiers": "tests/infra/cache/test_answer_cache.py",
    "infra/cache/kv_staging": "tests/infra/cache/test_kv_cache.py",
    "infra/corpus/formats": _DOCUMENTS,
    "infra/corpus/passages": _DOCUMENTS,
    "infra/embeddings/bert_gguf": "tests/infra/embeddings/test_embedder.py",
    "infra/engine/llama_batch": _LLAMA,
    "infra/engine/llama_context": _LLAMA,
    "infra/engine/llama_groups": _LLAMA,
    "infra/engine/llama_init": _LLAMA,
    "infra/engine/llama_layers": _LLAMA,
    "infra/engine/llama_vocab": _LLAMA,
    "infra/engine/cpu_builds/llama_probe": _CPU_BUILDS,
    "infra/models/heads_store": "tests/pipeline/test_heads.py",
    "infra/store/qdrant_edge": _QDRANT,
    "infra/store/qdrant_engine": _QDRANT,
    "infra/store/qdrant_facts": _QDRANT,
    "infra/store/qdrant_server": _QDRANT,
    "integrations/langchain": _ADAPTERS,
    "integrations/langchain_chat": _ADAPTERS,
    "integrations/llamaindex": _ADAPTERS,
    "integrations/sources": _ADAPTERS,
    # jobs: the batch's actors, inputs and records, evaluation's plots and curves, indexing
    "jobs/batch/batch_actors": _BATCH,
    "jobs/batch/batch_answers": _BATCH,
    "jobs/batch/batch_inputs": _BATCH,
    "jobs/batch/batch_records": _BATCH,
    "jobs/ray_pool": _BATCH,
    "jobs/evaluation/eval_plots": _EVAL,
    "jobs/evaluation/eval_questions": _EVAL,
    "jobs/evaluation/eval_report": _EVAL,
    "jobs/evaluation/ray_eval": _BATCH,
    "jobs/indexing": _QDRANT,
    "jobs/ray_indexing": _DOCUMENTS,
    # pipeline: critique parts through the critics
    "pipeline/critics/answerability": "tests/pipeline/test_answerability_model.py",
    "pipeline/critics/chat": "tests/pipeline/critics/test_learned.py",
    "pipeline/critics/factory": "tests/pipeline/critics/test_native.py",
    "pipeline/evaluation/baselines": _EVAL,
    "pipeline/learning/synthetic_qa": "tests/jobs/test_support_calibration.py",
    # runtime: the batch actor's engine worker, call merging and remote retriever
    "runtime/calibrated": "tests/infra/test_calibration_files.py",
    "runtime/engine_worker": _BATCH,
    "runtime/merging": _BATCH,
    "runtime/remote_retriever": _BATCH,
    "runtime/ray_logs": "tests/actors/test_serve_app_config.py",
    # schemas read and checked where they are loaded or sent
    "schemas/settings": "tests/infra/test_settings_loader.py",
    "schemas/documents": _DOCUMENTS,
    "schemas/openai": "tests/actors/http/test_openai_routes.py",
}

# Public modules with no direct test yet: the debt, listed so it can only shrink (a module
# that gets a test of its own must leave this list, and no new module may join it).
NO_DIRECT_TEST_YET: set[str] = set()


def _package_folders() -> set[str]:
    """Every package folder, relative to the root ("" is the root), by its __init__.py."""
    folders = {""}
    for here, dirs, files in os.walk(ROOT):
        rel = Path(here).relative_to(ROOT)
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith((".", "__"))
            and not d.endswith(".egg-info")
            and not (rel == Path(".") and d in NOT_PACKAGE)
        ]
        if rel != Path(".") and "__init__.py" in files:
            folders.add(rel.as_posix())
    return folders


def _public_modules() -> set[str]:
    """Every public module as its path without `.py`, e.g. "infra/engine/llama_engine"."""
    out = set()
    for folder in _package_folders():
        for p in (ROOT / folder).glob("*.py"):
            if p.stem not in NOT_MODULES and not p.stem.startswith("_"):
                out.add(p.relative_to(ROOT).with_suffix("").as_posix())
    return out


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _has_direct_test(module: str) -> bool:
    folder, _, name = module.rpartition("/")
    here = TESTS / folder
    return (here / f"test_{name}.py").exists() or any(here.glob(f"test_{name}_*.py"))


def _tests_a_root_module(path: Path) -> bool:
    return any(
        path.stem == f"test_{m}" or path.stem.startswith(f"test_{m}_")
        for m in _public_modules()
        if "/" not in m
    )


def test_every_test_file_sits_in_a_folder_that_mirrors_the_package():
    folders = _package_folders() | set(TEST_ONLY_FOLDERS)
    misplaced = []
    for path in _test_files():
        folder = path.parent.relative_to(TESTS).as_posix()
        folder = "" if folder == "." else folder
        if folder not in folders or (folder == "" and not _tests_a_root_module(path)):
            misplaced.append(path.relative_to(ROOT).as_posix())
    assert not misplaced, (
        "move these into the folder of tests/ that mirrors the package folder they test "
        f"(or tests/system/ for the whole system): {misplaced}"
    )


def test_every_public_module_has_a_direct_test():
    missing = sorted(
        m
        for m in _public_modules()
        if not _has_direct_test(m) and m not in COVERED_ELSEWHERE and m not in NO_DIRECT_TEST_YET
    )
    assert not missing, f"write tests/<folder>/test_<module>.py for: {missing}"


def test_the_allow_lists_hold_only_modules_that_exist_without_a_direct_test():
    listed = set(COVERED_ELSEWHERE) | NO_DIRECT_TEST_YET
    modules = _public_modules()
    assert not set(COVERED_ELSEWHERE) & NO_DIRECT_TEST_YET
    gone = sorted(m for m in listed if m not in modules)
    assert not gone, f"no such module, take it off the list: {gone}"
    tested = sorted(m for m in listed if _has_direct_test(m))
    assert not tested, f"these have a direct test now, take them off the list: {tested}"
    for module, test in COVERED_ELSEWHERE.items():
        assert (ROOT / test).exists(), f"{module}: {test} does not exist"
