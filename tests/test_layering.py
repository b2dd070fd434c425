"""The package's shape: imports point downward only, no circles, no private names across modules.

Layers, lowest first: schemas → pipeline → infra (adapters) → runtime → actors | jobs → the
Python API (api) → entry points (cli, ray_app) | framework adapters (integrations). Folders
on one layer sit side by side and never import each other. Function-level imports count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {
    "schemas": 0,
    "pipeline": 1,
    "infra": 2,
    "runtime": 3,
    "actors": 4,
    "jobs": 4,
    "api": 5,
    "integrations": 6,
    "cli": 6,
    "ray_app": 6,
    "__main__": 7,
}


def _modules() -> dict[str, Path]:
    out = {"selfrag": ROOT / "__init__.py"}
    for folder in LAYERS:
        path = ROOT / f"{folder}.py"
        if path.exists():
            out[f"selfrag.{folder}"] = path
        for p in sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else []:
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("selfrag", *parts)).removesuffix(".__init__")
            out[name] = p
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every `selfrag` import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "selfrag":
                out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "selfrag":
                    out.append((a.name, [], node.lineno))
    return out


def _target(module: str, name: str) -> str:
    """The module an import reads from: `from selfrag.x import y` is module `selfrag.x.y` when
    that is a module."""
    return f"{module}.{name}" if f"{module}.{name}" in MODULES else module


def _layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    if len(parts) == 1:
        return 9, ""  # the package itself: the public face, above everything
    return LAYERS[parts[1]], parts[1]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for module, names, _ in _imports(path):
            for target in [_target(module, n) for n in names] or [module]:
                if target in MODULES and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def test_the_wheel_lists_every_subpackage():
    """pyproject names the packages one by one (the root maps to `selfrag`): a new folder with
    an __init__.py must be listed, or a non-editable install lacks it."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {"selfrag"} | {
        ".".join(("selfrag", *p.parent.relative_to(ROOT).parts))
        for folder in LAYERS
        if (ROOT / folder).is_dir()
        for p in (ROOT / folder).rglob("__init__.py")
    }
    assert found == listed


def test_every_folder_module_is_found():
    assert "selfrag.pipeline.decoder" in MODULES
    assert "selfrag.cli" in MODULES
    assert len(MODULES) > 40


def test_imports_only_point_downward():
    wrong = []
    for name, path in MODULES.items():
        mine, my_folder = _layer(name)
        for module, names, line in _imports(path):
            for target in [_target(module, n) for n in names] or [module]:
                if target not in MODULES:
                    continue
                theirs, their_folder = _layer(target)
                sideways = mine == theirs and my_folder != their_folder
                if theirs > mine or sideways:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_circles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_no_private_names_cross_modules():
    crossing = [
        f"{path.relative_to(ROOT)}:{line} imports {module}.{n}"
        for path in MODULES.values()
        for module, names, line in _imports(path)
        for n in names
        if n.startswith("_")
    ]
    assert not crossing, "\n".join(crossing)


@pytest.mark.parametrize("folder", ["pipeline", "schemas"])
def test_the_algorithm_and_the_types_import_no_service_library(folder: str):
    heavy = {
        "ray",
        "redis",
        "qdrant_client",
        "qdrant_edge",
        "fastapi",
        "starlette",
        "llama_cpp",
        "torch",
    }
    found = [
        f"{p.relative_to(ROOT)} imports {a}"
        for p in (ROOT / folder).rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        for a in (
            [n.name for n in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if a.split(".")[0] in heavy
    ]
    assert not found, found
