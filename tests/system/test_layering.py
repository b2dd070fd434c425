"""The package's shape: imports point downward only, no circles, no private names across modules.

Layers, lowest first: schemas → pipeline → infra (adapters) → runtime → actors | jobs → the
Python API (api) → entry points (cli, ray_app) | framework adapters (integrations) → the
benchmarks and build scripts outside the package (bench, scripts). Folders on one layer sit side
by side and never import each other. Inside infra/ the same holds for its rooms (`INFRA_ROOMS`,
one per subpackage): corpus → infra's own modules → engine/cpu_builds → models | cache → engine |
embeddings | store. Function-level imports count, and so do relative imports,
`importlib.import_module`/`__import__` with a literal name, and reading `module._private`
through an imported module. Every top-level folder holding Python is scanned or named in
`NOT_SCANNED` with the reason: a new folder cannot slip past unchecked.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.paths import ROOT

PACKAGE = "selfrag"
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
    "bench": 8,
    "scripts": 8,
}
# infra/'s rooms, lowest first: a module belongs to the deepest room its path names ("" is
# infra's own modules); a room imports only from lower levels, and rooms on one level never
# import each other. engine/cpu_builds (which llama.cpp build this CPU runs, and the library's
# initialisation) sits below models, whose conversions and checks run llama.cpp, and below the
# engine and the embedder, which load it.
INFRA_ROOMS = {
    "corpus": 0,
    "": 1,
    "engine.cpu_builds": 2,
    "models": 3,
    "cache": 3,
    "engine": 4,
    "embeddings": 4,
    "store": 4,
}
# Top-level folders outside the package (their modules are `bench.x`, not `selfrag.bench.x`).
OUTSIDE_PACKAGE = {"bench", "scripts"}
NOT_SCANNED = {
    "tests": "tests reach into private names on purpose, to check them",
    "docs": "documentation",
}
SKIPPED_DIRS = {".venv", ".git", "__pycache__", ".ruff_cache", ".pytest_cache"}
IMPORT_CALLS = {"import_module", "__import__"}


@dataclass(frozen=True)
class Import:
    """One reference from a module to another: `target` is a module name."""

    target: str
    names: tuple[str, ...]
    line: int


def modules(root: Path) -> dict[str, Path]:
    """Every scanned module under `root` by its dotted name."""
    out = {PACKAGE: root / "__init__.py"}
    for folder in LAYERS:
        base = () if folder in OUTSIDE_PACKAGE else (PACKAGE,)
        path = root / f"{folder}.py"
        if path.exists():
            out[".".join((*base, folder))] = path
        for p in sorted((root / folder).rglob("*.py")) if (root / folder).is_dir() else []:
            parts = p.relative_to(root).with_suffix("").parts
            out[".".join((*base, *parts)).removesuffix(".__init__")] = p
    return out


def unlisted_folders(root: Path) -> list[str]:
    """Top-level folders holding Python that are neither a layer nor in NOT_SCANNED."""
    return sorted(
        d.name
        for d in root.iterdir()
        if d.is_dir()
        and d.name not in SKIPPED_DIRS
        and not d.name.startswith(".")
        and not d.name.endswith(".egg-info")
        and d.name not in LAYERS
        and d.name not in NOT_SCANNED
        and any(d.rglob("*.py"))
    )


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _relative_base(name: str, path: Path, level: int) -> str:
    parts = _package_of(name, path).split(".")
    return ".".join(parts[: len(parts) - (level - 1)]) if level - 1 < len(parts) else ""


def _literal_module(arg: ast.expr) -> str | None:
    """The module named by the first argument of an import call: a string literal, or the
    literal start of an f-string (`f"selfrag.x.{name}"` reads `selfrag.x`)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values:
        first = arg.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value.rstrip(".") or None
    return None


def _is_ours(module: str) -> bool:
    return module.split(".")[0] in {PACKAGE, *OUTSIDE_PACKAGE}


def imports(name: str, path: Path) -> list[Import]:
    """Every reference of module `name` (at `path`) to a module of the project."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = _relative_base(name, path, node.level)
                module = f"{base}.{module}" if module else base
            if module and _is_ours(module):
                out.append(Import(module, tuple(a.name for a in node.names), node.lineno))
        elif isinstance(node, ast.Import):
            out += [Import(a.name, (), node.lineno) for a in node.names if _is_ours(a.name)]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            module = _literal_module(node.args[0]) if called in IMPORT_CALLS else None
            if module and _is_ours(module):
                out.append(Import(module, (), node.lineno))
    return out


def _targets(imp: Import, known: dict[str, Path]) -> list[str]:
    """The modules an import reads from: `from selfrag.x import y` reads `selfrag.x.y` when
    that is a module."""
    found = [f"{imp.target}.{n}" if f"{imp.target}.{n}" in known else imp.target for n in imp.names]
    return found or [imp.target]


def _layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return LAYERS[parts[0]], parts[0]
    if len(parts) == 1:
        return 7, ""  # the package itself: the public face, above everything it re-exports
    return LAYERS[parts[1]], parts[1]


def upward_imports(root: Path) -> list[str]:
    known = modules(root)
    wrong = []
    for name, path in known.items():
        mine, my_folder = _layer(name)
        for imp in imports(name, path):
            for target in _targets(imp, known):
                if target not in known:
                    continue
                theirs, their_folder = _layer(target)
                sideways = mine == theirs and my_folder != their_folder
                if theirs > mine or sideways:
                    wrong.append(f"{path.relative_to(root)}:{imp.line} imports {target}")
    return wrong


def infra_room(module: str) -> str | None:
    """The room of infra/ that `module` belongs to (None: not in infra/)."""
    prefix = f"{PACKAGE}.infra"
    if module != prefix and not module.startswith(f"{prefix}."):
        return None
    rest = module.removeprefix(prefix).lstrip(".")
    parts = rest.split(".") if rest else []
    # The deepest room the name starts with: a package's __init__ is named as its room.
    for n in range(len(parts), 0, -1):
        if (room := ".".join(parts[:n])) in INFRA_ROOMS:
            return room
    return ""


def unlisted_infra_rooms(root: Path) -> list[str]:
    """Subpackages of infra/ that INFRA_ROOMS does not name (each is a room of its own: a new
    one must be placed)."""
    base = root / "infra"
    found = (".".join(p.parent.relative_to(base).parts) for p in sorted(base.rglob("__init__.py")))
    return sorted(room for room in found if room and room not in INFRA_ROOMS)


def infra_room_imports(root: Path) -> list[str]:
    """Imports between rooms of infra/ that do not point to a lower level."""
    known = modules(root)
    wrong = []
    for name, path in known.items():
        mine = infra_room(name)
        if mine is None:
            continue
        for imp in imports(name, path):
            for target in dict.fromkeys(_targets(imp, known)):
                theirs = infra_room(target)
                if target not in known or theirs is None or theirs == mine:
                    continue
                if INFRA_ROOMS[theirs] >= INFRA_ROOMS[mine]:
                    room = f"infra/{theirs.replace('.', '/')}" if theirs else "infra/"
                    wrong.append(f"{path.relative_to(root)}:{imp.line} imports {target} ({room})")
    return wrong


def import_graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {
        name: {
            t
            for imp in imports(name, path)
            for t in _targets(imp, known)
            if t in known and t != name
        }
        for name, path in known.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _module_aliases(name: str, path: Path, tree: ast.AST, known: dict[str, Path]) -> dict:
    """Local names bound to project modules: `import selfrag.x as m`, `from selfrag import x`
    (x a module), and `import selfrag.x` (binds `selfrag`, read through attribute chains)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_ours(a.name):
                    aliases[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = _relative_base(name, path, node.level)
                module = f"{base}.{module}" if module else base
            for a in node.names:
                if f"{module}.{a.name}" in known:
                    aliases[a.asname or a.name] = f"{module}.{a.name}"
    return aliases


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def private_crossings(root: Path) -> list[str]:
    known = modules(root)
    wrong = [
        f"{path.relative_to(root)}:{imp.line} imports {imp.target}.{n}"
        for name, path in known.items()
        for imp in imports(name, path)
        for n in imp.names
        if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))
    ]
    for name, path in known.items():
        wrong += [
            f"{path.relative_to(root)}:{node.lineno} reads {module}.{node.attr}"
            for module, node in _private_attribute_reads(name, path, known)
        ]
    return wrong


def _private_attribute_reads(
    name: str, path: Path, known: dict[str, Path]
) -> Iterator[tuple[str, ast.Attribute]]:
    """`module._x` where `module` names another project module."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = _module_aliases(name, path, tree, known)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        dotted = _dotted(node.value)
        head, _, rest = (dotted or "").partition(".")
        module = aliases.get(head)
        if module is None:
            continue
        module = f"{module}.{rest}" if rest else module
        if module in known and module != name:
            yield module, node


# --- the project ----------------------------------------------------------------------------


def test_the_wheel_lists_every_subpackage():
    """pyproject names the packages one by one (the root maps to `selfrag`): a new folder with
    an __init__.py must be listed, or a non-editable install lacks it."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {PACKAGE} | {
        ".".join((PACKAGE, *p.parent.relative_to(ROOT).parts))
        for folder in LAYERS
        if folder not in OUTSIDE_PACKAGE and (ROOT / folder).is_dir()
        for p in (ROOT / folder).rglob("__init__.py")
    }
    assert found == listed


def test_every_folder_module_is_found():
    found = modules(ROOT)
    assert "selfrag.pipeline.decoder" in found
    assert "selfrag.cli" in found
    assert "bench.vs_vanilla" in found
    assert len(found) > 40


def test_every_top_level_folder_is_scanned_or_named():
    assert not unlisted_folders(ROOT)


def test_imports_only_point_downward():
    wrong = upward_imports(ROOT)
    assert not wrong, "\n".join(wrong)


def test_every_infra_subpackage_is_a_room():
    assert not unlisted_infra_rooms(ROOT)


def test_infra_rooms_import_only_lower_rooms():
    wrong = infra_room_imports(ROOT)
    assert not wrong, "\n".join(wrong)


def test_no_import_circles():
    found = circles(import_graph(ROOT))
    assert not found, found


def test_no_private_names_cross_modules():
    wrong = private_crossings(ROOT)
    assert not wrong, "\n".join(wrong)


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


# --- planted violations: each rule catches what it claims to ---------------------------------


def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in ("schemas", "pipeline", "infra", "runtime"):
        (root / folder).mkdir(exist_ok=True)
        (root / folder / "__init__.py").touch()
    return root


def test_a_relative_upward_import_is_caught(tmp_path: Path):
    root = _plant(
        tmp_path, {"pipeline/algo.py": "from ..runtime import system\n", "runtime/system.py": ""}
    )
    assert upward_imports(root) == ["pipeline/algo.py:1 imports selfrag.runtime.system"]


def test_a_relative_downward_import_passes(tmp_path: Path):
    root = _plant(
        tmp_path,
        {
            "runtime/system.py": "from ..pipeline import algo\nfrom . import x\n",
            "pipeline/algo.py": "",
            "runtime/x.py": "",
        },
    )
    assert upward_imports(root) == []


@pytest.mark.parametrize(
    "code",
    [
        "import importlib\nm = importlib.import_module('selfrag.runtime.system')\n",
        "from importlib import import_module\nm = import_module('selfrag.runtime.system')\n",
        "m = __import__('selfrag.runtime.system')\n",
        "import importlib\nm = importlib.import_module(f'selfrag.runtime.{1}')\n",
    ],
)
def test_a_dynamic_upward_import_is_caught(tmp_path: Path, code: str):
    root = _plant(tmp_path, {"pipeline/algo.py": code, "runtime/system.py": ""})
    assert len(upward_imports(root)) == 1


@pytest.mark.parametrize(
    "code",
    [
        "from selfrag.pipeline import algo\nx = algo._hidden\n",
        "import selfrag.pipeline.algo as a\nx = a._hidden\n",
        "import selfrag.pipeline.algo\nx = selfrag.pipeline.algo._hidden\n",
        "from ..pipeline import algo\nx = algo._hidden\n",
    ],
)
def test_reading_a_private_attribute_of_another_module_is_caught(tmp_path: Path, code: str):
    root = _plant(tmp_path, {"runtime/system.py": code, "pipeline/algo.py": "_hidden = 1\n"})
    assert private_crossings(root) == ["runtime/system.py:2 reads selfrag.pipeline.algo._hidden"]


def test_dunder_attributes_and_own_privates_pass(tmp_path: Path):
    code = "from selfrag.pipeline import algo\nx = algo.__name__\n_y = 1\n"
    root = _plant(tmp_path, {"runtime/system.py": code, "pipeline/algo.py": ""})
    assert private_crossings(root) == []


def test_an_infra_room_importing_a_higher_or_sideways_room_is_caught(tmp_path: Path):
    root = _plant(
        tmp_path,
        {
            "infra/__init__.py": "",
            "infra/cache/__init__.py": "",
            "infra/cache/kv.py": "from selfrag.infra.engine import batch\n",
            "infra/models/__init__.py": "",
            "infra/models/files.py": "from selfrag.infra.cache import kv\n",
            "infra/engine/__init__.py": "",
            "infra/engine/batch.py": "from selfrag.infra.cache import kv\nfrom . import stats\n",
            "infra/engine/stats.py": "",
            "infra/engine/cpu_builds/__init__.py": "",
            "infra/engine/cpu_builds/init.py": "from selfrag.infra.engine import stats\n",
        },
    )
    assert infra_room_imports(root) == [
        "infra/cache/kv.py:1 imports selfrag.infra.engine.batch (infra/engine)",
        "infra/engine/cpu_builds/init.py:1 imports selfrag.infra.engine.stats (infra/engine)",
        "infra/models/files.py:1 imports selfrag.infra.cache.kv (infra/cache)",
    ]


def test_a_new_infra_subpackage_must_be_placed(tmp_path: Path):
    root = _plant(
        tmp_path,
        {
            "infra/__init__.py": "",
            "infra/engine/__init__.py": "",
            "infra/queue/__init__.py": "",
            "infra/engine/cpu_builds/__init__.py": "",
        },
    )
    assert unlisted_infra_rooms(root) == ["queue"]
    assert infra_room("selfrag.infra.engine.cpu_builds.init") == "engine.cpu_builds"
    assert infra_room("selfrag.infra.engine.batch") == "engine"
    assert infra_room("selfrag.infra.file_lock") == ""


def test_a_new_top_level_folder_must_be_listed(tmp_path: Path):
    root = _plant(tmp_path, {"newthing/mod.py": "from selfrag.runtime import system\n"})
    assert unlisted_folders(root) == ["newthing"]


def test_the_package_must_not_import_bench(tmp_path: Path):
    root = _plant(tmp_path, {"runtime/system.py": "from bench import soak\n", "bench/soak.py": ""})
    assert upward_imports(root) == ["runtime/system.py:1 imports bench.soak"]


def test_bench_may_import_the_package_but_not_its_privates(tmp_path: Path):
    code = "from selfrag.runtime import system\nfrom selfrag.runtime.system import _x\n"
    root = _plant(tmp_path, {"bench/soak.py": code, "runtime/system.py": "_x = 1\n"})
    assert upward_imports(root) == []
    assert private_crossings(root) == ["bench/soak.py:2 imports selfrag.runtime.system._x"]
