"""The package as a user installs it: `python -m build` makes an sdist and a wheel (from that
sdist) of the tracked files; each installs into a fresh venv and runs `selfrag --help`, and the
wheel indexes a folder and answers from it. The fresh venvs see this venv's dependencies
through a path file, so nothing is downloaded and no dependency is built again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.paths import ROOT


def _run(
    *cmd: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    # Without PYTHONPATH: a fresh venv must find selfrag in its own site folder only.
    clean = {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=clean, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{cmd}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and wheel built from a copy of the tracked files (the checkout is shared)."""
    tracked = _run("git", "ls-files", "-z", cwd=ROOT).stdout.split("\0")
    source = tmp_path_factory.mktemp("source")
    for name in filter(None, tracked):
        path = ROOT / name
        if path.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, source)
    return out


def _fresh_venv(path: Path) -> Path:
    """A venv without selfrag that imports this venv's dependencies (a path file; the path
    file's folder is not a site folder, so this venv's editable selfrag stays out)."""
    _run(sys.executable, "-m", "venv", "--without-pip", path)
    python = path / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    Path(site.stdout.strip(), "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _install(python: Path, artefact: Path) -> None:
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        artefact,
    )


def test_the_wheel_holds_the_package_and_its_data(dist: Path):
    (wheel,) = dist.glob("selfrag-*.whl")
    (sdist,) = dist.glob("selfrag-*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    assert "selfrag/actors/http/playground.html" in names
    assert any(n.startswith("selfrag/infra/models/shipped_heads/") for n in names)
    assert not any(n.startswith(("tests/", "bench/", "selfrag/tests/")) for n in names)
    assert sdist.stat().st_size > 0


def test_the_sdist_installs_and_runs(dist: Path, tmp_path: Path):
    (sdist,) = dist.glob("selfrag-*.tar.gz")
    python = _fresh_venv(tmp_path / "venv")
    _install(python, sdist)
    done = _run(python.parent / "selfrag", "--help")
    assert "usage: selfrag" in done.stdout


def test_the_wheel_installs_and_answers_from_a_folder(
    llama_model: Path, dist: Path, tmp_path: Path
):
    (wheel,) = dist.glob("selfrag-*.whl")
    python = _fresh_venv(tmp_path / "venv")
    _install(python, wheel)
    where = _run(python, "-c", "import selfrag; print(selfrag.__file__)").stdout
    assert where.startswith(str(tmp_path / "venv")), where
    selfrag = python.parent / "selfrag"
    assert "usage: selfrag" in _run(selfrag, "--help").stdout
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "normandy.md").write_text(
        "# Normandy\n\nRollo, a Viking leader, founded the Duchy of Normandy in 911.\n"
    )
    env = {**os.environ, "SELFRAG_HOME": str(tmp_path / "home")}
    _run(selfrag, "index", docs, "--no-calibrate", "--no-progress", env=env)
    answer = _run(selfrag, "ask", "Who founded the Duchy of Normandy?", "--json", env=env)
    assert '"answer"' in answer.stdout
