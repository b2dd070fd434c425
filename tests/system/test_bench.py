"""bench/ holds the benchmarks behind a figure of the docs: each runnable one answers `--help`
and is cited where its figure is recorded (docs/, notes/ or the README), and every other module
of bench/ is a part that one of them imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

BENCH = ROOT / "bench"
CITING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITING += sorted((ROOT / "notes").glob("*.md"))
# The question sets' own figures (how much of a set one search finds) are recorded beside them.
CITING.append(BENCH / "data" / "README.md")


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(BENCH.rglob("*.py")) if "__pycache__" not in p.parts}


def _runnable() -> list[str]:
    return [n for n, p in _modules().items() if '__name__ == "__main__"' in p.read_text()]


def _imported_by(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("bench")}
    return found


@pytest.mark.parametrize("module", _runnable())
def test_a_benchmark_answers_help(module: str):
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:"), done.stdout


@pytest.mark.parametrize("module", _runnable())
def test_a_benchmark_is_cited_where_its_figure_is(module: str):
    path = module.replace(".", "/") + ".py"
    assert any(path in p.read_text() or f"-m {module}" in p.read_text() for p in CITING), (
        f"{path} backs no figure of the README, docs/, notes/ or bench/data/README.md: "
        "record its result, or remove it"
    )


def test_every_other_bench_module_is_a_part_of_a_benchmark():
    modules = _modules()
    runnable = set(_runnable())
    imported = set().union(*(_imported_by(modules[n]) for n in modules))
    orphans = sorted(set(modules) - runnable - imported)
    assert not orphans, f"imported by no benchmark: {orphans}"
