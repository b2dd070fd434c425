"""The Python API: `from selfrag import SelfRAG`.

    with SelfRAG.open(home="~/rag") as rag:
        rag.index("corpus.jsonl")
        r = rag.answer("Who founded Normandy?", mode="always", top_k=3)
        print(r.answer, [s.citation for s in r.segments])
        passages = rag.retrieve("Who founded Normandy?", top_k=5)  # ranked by s_rel

    with SelfRAG.open(url="http://127.0.0.1:8000", api_key="...") as rag:  # a running server
        r = rag.answer("Who founded Normandy?")

In process, everything runs on the answer path the CLI, HTTP and batch jobs share (the
configured defaults, the first-use calibration, the query cache, the deadline); with `url` the
same calls, results and errors go through a running `selfrag serve`, which shares one model
between processes. Either way a `SelfRAG` answers through its `client`
(`runtime.answer_client.AnswerClient`).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

from selfrag.jobs.first_use import answering_runtime
from selfrag.jobs.indexing import IndexReport, index_corpus
from selfrag.jobs.kv_precompute import KVPrecompute, precompute_kv
from selfrag.runtime.answer_client import AnswerClient, LocalAnswerClient
from selfrag.runtime.answer_stream import SegmentStream, run_blocking
from selfrag.runtime.http_client import HTTPAnswerClient
from selfrag.runtime.system import LocalRuntime
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.documents import DocumentInfo, Removal
from selfrag.schemas.health import Health
from selfrag.schemas.retrieval import RankedPassage, RetrievalOrder, RetrieveRequest
from selfrag.schemas.settings import Settings

__all__ = ["SegmentStream", "SelfRAG"]


class ServedElsewhere(RuntimeError):
    """What only a `SelfRAG` in the process that holds the index can do (index, precompute KV
    states) was asked of one that answers through a server."""


class SelfRAG:
    """Self-RAG in this process, or through a running server (`open(url=...)`): index
    documents, answer questions with citations and per-segment scores, stream the segments as
    they are decoded, retrieve without drafting. Thread-safe; close it (or use it as a context
    manager) to free the model."""

    def __init__(self, settings: Settings) -> None:
        """Self-RAG in this process, on `settings` (`open` reads them as the CLI does)."""
        self.settings: Settings | None = settings
        self._runtime: LocalRuntime | None = answering_runtime(settings)
        self._server: HTTPAnswerClient | None = None
        self.client: AnswerClient = LocalAnswerClient.for_runtime(self._runtime)
        """The answer client (`runtime.answer_client.AnswerClient`): what the framework
        adapters (`selfrag.integrations`) answer with; in process, also what the HTTP app
        serves without Ray Serve (`actors.http.routes.build_local_http_app`)."""

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        api_key: str | None = None,
        home: str | Path | None = None,
        collection: str | None = None,
    ) -> SelfRAG:
        """Self-RAG through the server at `url` (`selfrag serve`): the same calls, results and
        errors as in process, but indexing. `api_key`: default `SELFRAG_API_KEY`, else the first
        of `SELFRAG_API_KEYS`. With `home` (a folder on this machine) and `collection`, every
        request names them, and a server of another home or collection refuses it
        (`runtime.http_client.WrongServer`) before doing anything."""
        from selfrag.infra.home_identity import home_id

        rag = cls.__new__(cls)
        rag.settings = None
        rag._runtime = None
        ident = home_id(Path(home).expanduser()) if home is not None else None
        rag._server = HTTPAnswerClient(url, api_key=api_key, home_id=ident, collection=collection)
        rag.client = rag._server
        return rag

    @classmethod
    def open(
        cls,
        home: str | Path | None = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        collection: str | None = None,
        config: str | Path | None = None,
        **settings: Any,
    ) -> SelfRAG:
        """Open a home (default: `SELFRAG_HOME`, else the user data folder) in this process,
        or with `url` connect to the server there (`connect`; `home` and `collection` then
        name what it must serve). In process, settings come as for the CLI: `config` (a TOML
        file), the environment, then `settings` (sections as dicts, e.g.
        `model={"n_threads": 1}`), and `collection` the configured one; bad ones raise
        `SettingsError`."""
        if url is not None:
            if config is not None or settings:
                raise TypeError(
                    "settings apply to Self-RAG in this process; a server answers with its own"
                )
            return cls.connect(url, api_key=api_key, home=home, collection=collection)
        if api_key is not None:
            raise TypeError("api_key is for a server (url=...)")
        from selfrag.infra.settings_loader import load_settings

        overrides = dict(settings)
        if home is not None:
            overrides["home"] = str(Path(home).expanduser())
        if collection is not None:
            overrides["retrieval"] = {**overrides.get("retrieval", {}), "collection": collection}
        path = Path(config).expanduser() if config is not None else None
        return cls(load_settings(config_path=path, overrides=overrides))

    @property
    def url(self) -> str | None:
        """The server this answers through; None in process."""
        return self._server.url if self._server is not None else None

    @property
    def system(self) -> LocalRuntime:
        """The runtime in this process (model, store, critics); `ServedElsewhere` through a
        server."""
        if self._runtime is None:
            raise ServedElsewhere(
                f"this SelfRAG answers through the server at {self.url}: indexing and the "
                "model's parts are where its home is (`selfrag --home HOME index PATH` there)"
            )
        return self._runtime

    # --- the index -------------------------------------------------------------------------------

    def index(
        self,
        *paths: str | Path,
        progress: bool = False,
        follow_links: bool = False,
        collection: str | None = None,
    ) -> list[IndexReport]:
        """Index JSONL, SQuAD JSON, .txt/.md/.pdf/.html files or folders of them into this
        home; one report per path (its bad records and the files it did not read are in
        `errors`, the rest is indexed; the documents gone from it since it was last indexed
        are removed: `removed`). Symbolic links out of a folder are followed only with
        `follow_links`. `collection`: another collection of this home than the configured one
        (each call's `collection` keeps its corpus apart). A missing path raises
        FileNotFoundError before anything is written. In process only."""
        system = self.system
        for path in paths:
            if not Path(path).exists():
                raise FileNotFoundError(f"no such file or folder: {path}")
        store = system.for_collection(collection).store
        return [
            index_corpus(
                path,
                store,
                progress=progress,
                retrieval=system.settings.retrieval,
                follow_links=follow_links,
            )
            for path in paths
        ]

    def count(self, collection: str | None = None) -> int:
        """Passages in the index (of `collection`, default the configured one)."""
        if self._server is not None:
            return sum(d.passages for d in self.documents(collection))
        return self.system.for_collection(collection).store.count()

    def documents(self, collection: str | None = None) -> list[DocumentInfo]:
        """The indexed documents: id, source file, title, passages, when indexed."""
        if self._server is not None:
            server = self._server
            return run_blocking(lambda: server.documents(collection))
        return self.system.for_collection(collection).store.documents()

    def remove(self, *refs: str | Path, collection: str | None = None) -> Removal:
        """Take documents out of the index: each ref a document id, or the file or folder
        they were indexed from. Their passages leave every search and no cached answer that
        cites them is served again (the index version changes)."""
        names = [str(r) for r in refs]
        if self._server is not None:
            server = self._server
            return run_blocking(lambda: server.remove(names, collection))
        return self.system.for_collection(collection).store.remove(names)

    def precompute_kv(self, progress: bool = False) -> KVPrecompute:
        """Save every indexed passage's KV state to the disk tier (`HOME/kv`), so answers
        start warm, in every process of the node and after a restart. ValueError when the
        configuration has no disk tier. In process only."""
        return precompute_kv(self.system, progress=progress)

    # --- answers ---------------------------------------------------------------------------------

    def answer(
        self,
        question: str,
        *,
        max_tokens: int | None = None,
        collection: str | None = None,
        **dials: Any,
    ) -> AnswerResponse:
        """Answer `question` (from `collection`, default the configured one); `dials` override
        any `DecodingConfig` field for this answer (bad ones raise pydantic's ValidationError
        naming the field). Failures raise the kinds of `selfrag.schemas.errors` (e.g.
        `DeadlineExceeded` past `timeout_s`)."""
        request = AnswerRequest.of(question, max_tokens=max_tokens, collection=collection, **dials)
        return self.client.answer(request).response

    async def aanswer(
        self,
        question: str,
        *,
        max_tokens: int | None = None,
        collection: str | None = None,
        **dials: Any,
    ) -> AnswerResponse:
        """`answer` without blocking the event loop."""
        request = AnswerRequest.of(question, max_tokens=max_tokens, collection=collection, **dials)
        return (await self.client.aanswer(request)).response

    def stream(
        self,
        question: str,
        *,
        max_tokens: int | None = None,
        collection: str | None = None,
        **dials: Any,
    ) -> SegmentStream:
        """Iterate the leading hypothesis's segments as they are decoded (`SegmentEvent`:
        index i replaces any segment with index ≥ i seen before, since the beam's leader can
        change); the full answer is `.response` once the iteration ends. Leaving the loop
        early stops the decode at its next step."""
        request = AnswerRequest.of(question, max_tokens=max_tokens, collection=collection, **dials)
        return self.client.stream(request)

    def astream(
        self,
        question: str,
        *,
        max_tokens: int | None = None,
        collection: str | None = None,
        **dials: Any,
    ) -> SegmentStream:
        """`stream` for asyncio: `async for event in rag.astream(q)`, then `.response`."""
        return self.stream(question, max_tokens=max_tokens, collection=collection, **dials)

    def retrieve(
        self,
        query: str,
        *,
        top_k: int | None = None,
        critique: str | None = None,
        order: RetrievalOrder = "relevance",
        collection: str | None = None,
    ) -> list[RankedPassage]:
        """The `top_k` passages the store finds for `query` (default: the configured top_k),
        most relevant first by the critique's relevance read (s_rel), no answer drafted;
        `order="retriever"`: in the store's order, nothing read."""
        return self.client.retrieve(_retrieval(query, top_k, critique, order, collection))

    async def aretrieve(
        self,
        query: str,
        *,
        top_k: int | None = None,
        critique: str | None = None,
        order: RetrievalOrder = "relevance",
        collection: str | None = None,
    ) -> list[RankedPassage]:
        """`retrieve` without blocking the event loop."""
        return await self.client.aretrieve(_retrieval(query, top_k, critique, order, collection))

    def health(self) -> Health:
        """Whether the model, the store and the cache answer now, and the home and collection
        answered from."""
        return run_blocking(self.client.health)

    # --- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the answers still decoding (streams among them), then free the model, the
        store and the caches."""
        self.client.close()
        if self._runtime is not None:
            self._runtime.close()

    def __enter__(self) -> SelfRAG:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _retrieval(
    query: str,
    top_k: int | None,
    critique: str | None,
    order: RetrievalOrder,
    collection: str | None,
) -> RetrieveRequest:
    return RetrieveRequest.model_validate(
        {
            "query": query,
            "top_k": top_k,
            "critique": critique,
            "order": order,
            "collection": collection,
        }
    )
