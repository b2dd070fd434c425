"""Permanent store errors (no index; an index of another vector size) are a clear error when
the store opens and a 500 `misconfigured` with the reason when serving, never a 503 that
clients retry forever; a server that does not answer stays 503. Real embedded Qdrant; the
`Retriever` deployment's class without Ray; the real HTTP app over the answer service."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from selfrag.actors.deployments import Retriever
from selfrag.actors.http.routes import build_http_app
from selfrag.infra.embeddings.embedder import SentenceEmbedder
from selfrag.infra.settings_loader import load_settings
from selfrag.infra.store.qdrant_store import IndexMissing, QdrantStore, StoreMisconfigured
from selfrag.pipeline.protocols import Passage
from selfrag.schemas.errors import DependencyDown, Misconfigured
from selfrag.schemas.settings import RetrievalSettings, Settings
from tests.redis_proc import free_port
from tests.serve_fakes import make_service
from tests.suite import SUITE_ENV

PASSAGES = [
    Passage("rollo#0", "Rollo was the first ruler of Normandy.", "Rollo", metadata={"doc_id": "r"}),
    Passage("lava#0", "Lava escapes from a magma chamber.", "Volcano", metadata={"doc_id": "v"}),
]


class HashEmbedder:
    """Deterministic unit vectors of any width under any model id: an index "built by" an
    embedder of another size, without a second model to load."""

    def __init__(self, dim: int, model_id: str = "hash-embedder") -> None:
        self.dim = dim
        self.model_id = model_id

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        rows = []
        for text in texts:
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
            row = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
            rows.append(row / np.linalg.norm(row))
        return np.array(rows, dtype=np.float32).reshape(len(texts), self.dim)


def _index(home: Path, embedder: HashEmbedder) -> None:
    with QdrantStore.open(RetrievalSettings(), home, embedder) as store:
        assert store.upsert(PASSAGES) == 2


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return load_settings(environ={"SELFRAG_HOME": str(tmp_path / "home"), **SUITE_ENV})


@pytest.fixture
def real_model_id(settings: Settings) -> str:
    # Cheap: read from the model's config files, the model itself is never loaded.
    return SentenceEmbedder(settings.retrieval.embedding_model).model_id


def test_an_index_of_another_vector_size_is_refused_when_the_store_opens(tmp_path: Path):
    _index(tmp_path, HashEmbedder(8, "same-model"))
    with pytest.raises(StoreMisconfigured, match=r"vectors of size 8.* gives 16: re-index"):
        QdrantStore.open(RetrievalSettings(), tmp_path, HashEmbedder(16, "same-model"))
    # The refused open released the folder; the right embedder still searches it.
    with QdrantStore.open(RetrievalSettings(), tmp_path, HashEmbedder(8, "same-model")) as store:
        store.require_index()
        assert store.count() == 2
        assert store.search("Rollo was the first ruler of Normandy.", 1)[0].id == "rollo#0"


def test_a_missing_collection_is_an_error_that_says_to_index(tmp_path: Path):
    with QdrantStore.open(RetrievalSettings(), tmp_path, HashEmbedder(8)) as store:
        with pytest.raises(IndexMissing, match=r"does not exist in .*run `selfrag index PATH`"):
            store.require_index()
        assert store.search("anything", 2) == []  # the store itself still answers
        store.upsert(PASSAGES)
        store.require_index()


def test_the_retriever_answers_500_misconfigured_for_an_index_of_another_size(
    settings: Settings, real_model_id: str
):
    # Built under the configured embedder's id but with 8-dimensional vectors, as by an older
    # version of the same model name, or a collection created by hand.
    _index(settings.home, HashEmbedder(8, real_model_id))
    retriever = Retriever.func_or_class(settings)
    try:
        assert retriever.ready() is False
        for call in (
            lambda: retriever.search("Who ruled Normandy?", 2),
            lambda: retriever.search_many(["Who ruled Normandy?"], 2),
            retriever.index_version,
        ):
            with pytest.raises(Misconfigured, match="vectors of size 8, but the embedder") as err:
                call()
            assert (err.value.status, err.value.kind) == (500, "misconfigured")
    finally:
        retriever.close()


def test_a_retriever_started_on_an_empty_home_serves_an_index_built_by_another_process(
    llama_model: Path, settings: Settings, real_model_id: str
):
    """`selfrag index` in another process after the server started: once that process has
    closed the index, the running Retriever serves it, without a restart."""
    retriever = Retriever.func_or_class(settings)
    try:
        assert retriever.ready() is False
        code = textwrap.dedent(
            """
            import hashlib, sys
            from pathlib import Path
            import numpy as np
            from selfrag.infra.store.qdrant_store import QdrantStore
            from selfrag.pipeline.protocols import Passage
            from selfrag.schemas.settings import RetrievalSettings

            class HashEmbedder:
                dim = int(sys.argv[3])
                model_id = sys.argv[2]

                def embed(self, texts):
                    rows = []
                    for text in texts:
                        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
                        row = np.random.default_rng(seed).standard_normal(self.dim)
                        rows.append(row / np.linalg.norm(row))
                    return np.array(rows, dtype=np.float32).reshape(len(texts), self.dim)

            passages = [Passage(f"p{i}", f"Passage {i} on the Normans.", None) for i in range(3)]
            with QdrantStore.open(RetrievalSettings(), Path(sys.argv[1]), HashEmbedder()) as store:
                store.upsert(passages)
            """
        )
        dim = retriever._open().embedder.dim
        child = subprocess.run(
            [sys.executable, "-c", code, str(settings.home), real_model_id, str(dim)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert child.returncode == 0, child.stderr
        deadline = time.monotonic() + 5  # looked for at most once a second
        while not retriever.ready():
            assert time.monotonic() < deadline, "the index built meanwhile is not served"
            time.sleep(0.1)
        assert len(retriever.search("Who ruled Normandy?", 2)) == 2
        one, two = retriever.search_many(["Who ruled Normandy?", "Passage 1"], 2)
        assert one == retriever.search("Who ruled Normandy?", 2) and len(two) == 2
        assert retriever.index_version() != "empty"
    finally:
        retriever.close()


def test_the_retriever_with_no_index_answers_500_saying_to_index(
    llama_model: Path, settings: Settings
):
    retriever = Retriever.func_or_class(settings)
    try:
        assert retriever.ready() is False
        with pytest.raises(Misconfigured, match="no passages are indexed: run `selfrag index"):
            retriever.search("Who ruled Normandy?", 2)
        # The detail shown to clients does not name the server's folder.
        with pytest.raises(Misconfigured) as err:
            retriever.index_version()
        assert str(settings.home) not in err.value.detail
        # Indexed meanwhile (here through the same open store): served without a restart.
        store = retriever._open()
        store.upsert(PASSAGES)
        assert retriever.ready() is True
        assert [p.id for p in retriever.search("Rollo was the first ruler of Normandy.", 1)] == [
            "rollo#0"
        ]
    finally:
        retriever.close()


@pytest.fixture
def misconfigured_client(settings: Settings, real_model_id: str) -> Iterator[TestClient]:
    """The HTTP app over the answer service whose retriever is the real `Retriever` class
    on an index of the wrong vector size."""
    _index(settings.home, HashEmbedder(8, real_model_id))
    retriever = Retriever.func_or_class(settings)
    rig = make_service(store=retriever)  # type: ignore[arg-type]
    try:
        yield TestClient(build_http_app(rig.service, rig.metrics))
    finally:
        retriever.close()


def test_over_http_a_permanent_store_error_is_500_without_retry_after(
    misconfigured_client: TestClient,
):
    body = {"question": "Who ruled Normandy?", "config": {"mode": "always"}}
    response = misconfigured_client.post("/v1/answer", json=body)
    assert response.status_code == 500, response.text
    assert response.json()["error"] == "misconfigured"
    assert "vectors of size 8" in response.json()["detail"]
    assert "retry-after" not in response.headers
    ready = misconfigured_client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["store"] is False


def test_a_server_that_does_not_answer_stays_503(tmp_path: Path):
    settings = load_settings(
        environ={
            "SELFRAG_HOME": str(tmp_path / "home"),
            "SELFRAG_RETRIEVAL__QDRANT_URL": f"http://127.0.0.1:{free_port()}",
            **SUITE_ENV,
        }
    )
    retriever = Retriever.func_or_class(settings)
    with pytest.raises(DependencyDown) as err:
        retriever.search("q", 1)
    assert err.value.status == 503
    assert "127.0.0.1" not in err.value.detail  # the address stays in the server's log


def test_ask_with_an_index_of_another_size_is_a_message_not_a_traceback(
    settings: Settings, real_model_id: str, capsys: pytest.CaptureFixture[str]
):
    from selfrag.cli import main

    _index(settings.home, HashEmbedder(8, real_model_id))
    assert main(["--home", str(settings.home), "ask", "Who ruled Normandy?"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("selfrag: collection ") and "vectors of size 8" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_reason_that_names_a_folder_or_server_is_not_shown(tmp_path: Path):
    from selfrag.runtime.passage_service import public_reason

    kept = "collection 'c' holds vectors of size 8, but the embedder org/model-v1 gives 16"
    assert public_reason(StoreMisconfigured(kept)) == kept
    for named in (
        f"{tmp_path}/edge/selfrag/index.json is unreadable (Expecting value): re-index",
        "the collection 'c' cannot be read from http://qdrant:6333",
    ):
        shown = public_reason(StoreMisconfigured(named))
        assert str(tmp_path) not in shown and "qdrant:6333" not in shown
        assert "server log" in shown


def test_over_http_an_unreadable_index_description_does_not_show_the_folder(
    settings: Settings, real_model_id: str, caplog: pytest.LogCaptureFixture
):
    _index(settings.home, HashEmbedder(8, real_model_id))
    (facts,) = settings.home.rglob("index.json")
    facts.write_text("{not json")
    caplog.set_level("ERROR", logger="selfrag.actors")
    retriever = Retriever.func_or_class(settings)
    try:
        rig = make_service(store=retriever)  # type: ignore[arg-type]
        c = TestClient(build_http_app(rig.service, rig.metrics))
        for _ in range(2):
            r = c.post("/v1/answer", json={"question": "Who ruled Normandy?"})
            assert r.status_code == 500 and r.json()["error"] == "misconfigured", r.text
            assert str(settings.home) not in r.text and "index.json" not in r.text
    finally:
        retriever.close()
    # The detail, with the folder, is in the server's log, once.
    assert sum(str(facts) in x.getMessage() for x in caplog.records) == 1
