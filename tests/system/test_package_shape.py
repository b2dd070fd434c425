"""The package's module names say one thing (no two modules share a name), and every folder
holding its modules is an installed package (`docs/architecture.md` maps the folders). A
folder's size follows from its subsystem and a module's from its job: neither is capped here
(ruff's complexity rules guard the size of a function instead)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tests.paths import ROOT

OUTSIDE = {"tests", "bench", "scripts", "docs", ".venv", ".git"}
ENTRY_NAMES = {"__init__.py", "__main__.py"}


def _package_modules() -> list[Path]:
    return [
        p
        for p in ROOT.rglob("*.py")
        if not OUTSIDE & set(p.relative_to(ROOT).parts)
        and "__pycache__" not in p.parts
        and p.name not in ENTRY_NAMES
    ]


def test_no_two_modules_share_a_name():
    names = Counter(p.name for p in _package_modules())
    twins = sorted(p.relative_to(ROOT).as_posix() for p in _package_modules() if names[p.name] > 1)
    assert not twins, f"modules named alike in different folders: {twins}"


def test_every_package_folder_is_an_installed_package():
    import tomllib

    declared = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {p.parent for p in _package_modules()} | {
        p.parent for p in ROOT.rglob("__init__.py") if not OUTSIDE & set(p.parts)
    }
    expected = {
        ".".join(["selfrag", *f.relative_to(ROOT).parts])
        for f in folders
        if "__pycache__" not in f.parts and not OUTSIDE & set(f.relative_to(ROOT).parts)
    }
    assert expected == declared, (expected - declared, declared - expected)
