"""The README and the docs site: the README stays short and keeps its two commands, the site
builds in strict mode (broken links, anchors and references fail), every `selfrag` command
line in them parses, and the Python examples run (those that need no server)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from selfrag.cli.parser import build_parser
from tests.paths import ROOT

DOCS = ROOT / "docs"
INSTALL_AND_RUN = (
    "bash scripts/install.sh && .venv/bin/selfrag index ../shared/data/squad_v2_small.json "
    "../shared/data/wiki_sample_1000.jsonl && .venv/bin/selfrag ask "
    '"Who was the Norse leader who founded Normandy?"'
)
FENCE = re.compile(r"^```(\w+)?\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_the_readme_is_short_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert INSTALL_AND_RUN in readme
    assert "\nbash scripts/test.sh\n" in readme
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link


def test_the_site_builds_strict(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    # Generated from the schemas: a settings field and a decoding dial, with their env names.
    assert "SELFRAG_MODEL__N_THREADS" in reference and "SELFRAG_DECODING__TEMPERATURE" in reference


def _command_lines() -> list[tuple[str, list[str]]]:
    """Every `selfrag ...` line of the bash blocks, split into arguments (after `selfrag`)."""
    found = []
    for page in _pages():
        for block in _blocks(page, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                for command in line.split("&&"):
                    words = shlex.split(command, comments=True)
                    if words and words[0] in ("selfrag", ".venv/bin/selfrag"):
                        found.append((f"{page.name}: {command.strip()}", words[1:]))
    return found


def test_every_selfrag_command_line_in_the_docs_parses():
    lines = _command_lines()
    assert len(lines) > 20
    parser = build_parser()
    bad = []
    for shown, words in lines:
        if any("$" in w for w in words):
            continue  # a shell variable stands for arguments shown elsewhere
        # Placeholders ("C ...", "[--qa DATA.json]") stand for arguments, not flags.
        args, optional = [], False
        for w in words:
            optional = optional or w.startswith("[")
            if not optional and w != "...":
                args.append(w)
            optional = optional and not w.endswith("]")
        try:
            parser.parse_args(args)
        except SystemExit:
            bad.append(shown)
    assert not bad, bad


def _python_examples() -> list[tuple[str, str]]:
    """The Python examples that need no server: the README's and the Python and framework
    pages'."""
    pages = [ROOT / "README.md", DOCS / "python.md", DOCS / "integrations.md"]
    return [
        (f"{page.name}#{i}", code)
        for page in pages
        for i, code in enumerate(_blocks(page, "python"))
        if "OpenAI(" not in code and "open(url=" not in code  # those need a server
    ]


@pytest.mark.real
@pytest.mark.parametrize(("name", "code"), _python_examples(), ids=lambda v: str(v)[:40])
def test_the_python_examples_run(name: str, code: str, normans_api_home: Path, tmp_path: Path):
    env = {**os.environ, "SELFRAG_HOME": str(normans_api_home)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{name}:\n{code}\n{done.stdout}\n{done.stderr}"
