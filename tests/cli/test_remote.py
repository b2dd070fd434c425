"""cli/remote.py: while another process holds a home's store, `selfrag ask` and `selfrag docs`
go through the server at serve.port only when it serves that home and collection; a server of
another home is told nothing, and refuses what names another home anyway. The servers here are
the HTTP app over a real embedded store in a child process (no model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from selfrag.cli import main
from selfrag.infra.home_identity import home_id
from tests.corpus_files import write_pdf
from tests.paths import ROOT

pytestmark = pytest.mark.real

_CHILD = """
import sys, time
from pathlib import Path
from selfrag.actors.http.routes import build_http_app, parse_api_keys
from selfrag.actors.http.metrics import Metrics
from selfrag.infra.home_identity import home_id
from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.jobs.indexing import index_corpus
from selfrag.schemas.health import ServedIndex
from selfrag.schemas.settings import RetrievalSettings
from tests.fakes import HashEmbedder
from tests.http_fakes import FakeService, live_server
from tests.infra.store.test_qdrant_documents import StoreDocuments

home, corpus, mode, keys = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
if sys.argv[5] == "hash":
    embedder = HashEmbedder()
else:  # the real one, as `selfrag` opens the index with
    from selfrag.infra.settings_loader import load_settings
    from selfrag.runtime.model_artefacts import open_embedder

    embedder = open_embedder(load_settings(overrides={"home": str(home)}))
with QdrantStore.open(RetrievalSettings(), home, embedder) as store:
    index_corpus(corpus, store, progress=False)
    if mode == "hold":
        print("holding", flush=True)
        time.sleep(600)
    served = ServedIndex(home_id=home_id(home), collection=store.collection)
    app = build_http_app(
        FakeService(served=served),
        Metrics(),
        api_keys=parse_api_keys(keys),
        documents=StoreDocuments(store),
    )
    with live_server(app) as url:
        print(url, flush=True)
        time.sleep(600)
"""


class Child:
    """A process holding (`hold`) or serving (`serve`, with `keys`) a home indexed from a
    folder with a hashing embedder, or the real one (`embedder="real"`); killed on exit."""

    def __init__(
        self, home: Path, corpus: Path, mode: str, keys: str = "", embedder: str = "hash"
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(home), str(corpus), mode, keys, embedder],
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.line = self.proc.stdout.readline().strip()

    @property
    def port(self) -> str:
        return self.line.rsplit(":", 1)[1]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.stop()


def _corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "notes.txt").write_text("Notes about lava.\n\nMore notes.", encoding="utf-8")
    write_pdf(folder / "paper.pdf", [["Page one."], ["Page two."]], title="Paper")
    return folder


def _documents(port: str, home: Path) -> set[str]:
    r = httpx.get(
        f"http://127.0.0.1:{port}/v1/documents",
        headers={"Authorization": "Bearer k1", "X-Selfrag-Home": home_id(home)},
    )
    assert r.status_code == 200, r.text
    return {d["id"] for d in r.json()}


def test_a_command_for_home_b_never_acts_on_the_server_of_home_a(
    tmp_path: Path,
    children: list[Child],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It did: with home A served (keys set) and B's store busy, `selfrag --home B docs rm ID`
    printed "removed 1 documents ... from B" and deleted the document from A; `docs list` and
    `ask` for B showed A's."""
    corpus = _corpus(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    children.append(server := Child(a, corpus, "serve", "k1"))
    children.append(holder := Child(b, corpus, "hold"))
    assert holder.line == "holding"
    monkeypatch.setenv("SELFRAG_SERVE__PORT", server.port)
    monkeypatch.setenv("SELFRAG_API_KEYS", "k1")
    in_a = _documents(server.port, a)
    paper = next(d for d in in_a if d.startswith("paper.pdf"))

    for argv in (["docs", "rm", paper], ["docs", "list"], ["ask", "What is lava?"]):
        assert main(["--home", str(b), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert "serves another home or collection" in err and "nothing was sent" in err
        assert f"by pid {holder.proc.pid}" in err
    assert _documents(server.port, a) == in_a  # nothing left A

    # The server refuses on its own what names another home or collection (409), untouched.
    url = f"http://127.0.0.1:{server.port}/v1/documents/{quote(paper, safe='')}"
    for named in ({"X-Selfrag-Home": home_id(b)}, {"X-Selfrag-Collection": "other"}):
        r = httpx.delete(url, headers={"Authorization": "Bearer k1", **named})
        assert r.status_code == 409 and r.json()["error"] == "wrong_home", r.text
    assert _documents(server.port, a) == in_a

    # Home A's own commands go through its server.
    assert main(["--home", str(a), "docs", "list", "--json"]) == 0  # through A's server
    assert {d["id"] for d in json.loads(capsys.readouterr().out)} == in_a
    holder.stop()
    children.remove(holder)
    assert main(["--home", str(a), "docs", "rm", paper]) == 0
    assert f"removed 1 documents, 2 passages from {a}" in capsys.readouterr().out
    assert _documents(server.port, a) == in_a - {paper}


def test_without_keys_a_removal_is_refused_with_advice_that_works(
    tmp_path: Path,
    children: list[Child],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The 403 said to run `selfrag docs rm` on the server's machine, which goes through the
    same route and gets the same 403."""
    corpus = _corpus(tmp_path)
    home = tmp_path / "a"
    children.append(server := Child(home, corpus, "serve", "", embedder="real"))
    monkeypatch.setenv("SELFRAG_SERVE__PORT", server.port)
    monkeypatch.delenv("SELFRAG_API_KEYS", raising=False)
    notes = str(corpus / "notes.txt")
    assert main(["--home", str(home), "docs", "rm", notes]) == 2
    err = capsys.readouterr().err
    assert "answered 403" in err and "stop the server and run `selfrag docs rm`" in err
    # The advice, followed: the server stopped, the command opens the index itself.
    server.stop()
    children.remove(server)
    assert main(["--home", str(home), "docs", "rm", "--json", notes]) == 0
    assert len(json.loads(capsys.readouterr().out)["documents"]) == 1


def test_the_cli_goes_through_the_server_of_its_home_or_names_the_holder(
    tmp_path: Path,
    children: list[Child],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    corpus = _corpus(tmp_path)
    home = tmp_path / "home"
    children.append(holder := Child(home, corpus, "hold"))
    monkeypatch.setenv("SELFRAG_SERVE__PORT", "9")  # nothing answers there
    assert main(["--home", str(home), "docs", "list"]) == 2
    err = capsys.readouterr().err
    assert f"is held by pid {holder.proc.pid} (" in err and "no selfrag server" in err
    holder.stop()
    children.remove(holder)

    children.append(server := Child(home, corpus, "serve", "k1"))
    monkeypatch.setenv("SELFRAG_SERVE__PORT", server.port)
    monkeypatch.setenv("SELFRAG_API_KEYS", "k1")
    assert main(["--home", str(home), "docs", "list", "--json"]) == 0
    names = {Path(d["source"]).name for d in json.loads(capsys.readouterr().out)}
    assert names == {"notes.txt", "paper.pdf"}
    assert main(["--home", str(home), "docs", "rm", str(corpus / "notes.txt"), "nope"]) == 1
    out = capsys.readouterr().out
    assert "removed 1 documents" in out and "no indexed document is nope" in out
    assert main(["--home", str(home), "ask", "Who founded Normandy?", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["question"] == "Who founded Normandy?"
