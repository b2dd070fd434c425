"""The Python API: `from selfrag import SelfRAG`.

    with SelfRAG.open(home="~/rag") as rag:
        rag.index("corpus.jsonl")
        r = rag.answer("Who founded Normandy?", mode="always", top_k=3)
        print(r.answer, [s.citation for s in r.segments])
        passages = rag.retrieve("Who founded Normandy?", top_k=5)  # ranked by s_rel

Everything runs in this process on the answer path the CLI, HTTP and batch jobs share (the
configured defaults, the query cache, the deadline); `selfrag serve` is the way to share one
model between processes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import TracebackType
from typing import Any

from selfrag.jobs.indexing import IndexReport, index_corpus
from selfrag.jobs.kv_precompute import KVPrecompute, precompute_kv
from selfrag.runtime.answer_client import LocalAnswerClient
from selfrag.runtime.answer_stream import SegmentStream
from selfrag.runtime.relevance import ranked_passages
from selfrag.runtime.system import LocalRuntime
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingOverrides
from selfrag.schemas.documents import DocumentInfo, Removal
from selfrag.schemas.retrieval import RankedPassage
from selfrag.schemas.settings import Settings

__all__ = ["SegmentStream", "SelfRAG"]


class SelfRAG:
    """Self-RAG in this process: index documents, answer questions with citations and
    per-segment scores, stream the segments as they are decoded. Thread-safe; close it (or use
    it as a context manager) to free the model."""

    # How long `close` waits for the answers still decoding to reach their next step.
    CLOSE_WAIT_S = 60.0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.system = LocalRuntime(settings)
        self.client = LocalAnswerClient.for_runtime(self.system)
        """The answer client of this process (`runtime.answer_client.AnswerClient`): what the
        framework adapters (`selfrag.integrations`) answer with, and what the HTTP app serves
        without Ray Serve (`actors.http.routes.build_local_http_app`)."""

    @classmethod
    def open(
        cls,
        home: str | Path | None = None,
        *,
        config: str | Path | None = None,
        **settings: Any,
    ) -> SelfRAG:
        """Open a home (default: `SELFRAG_HOME`, else the user data folder). Settings come as
        for the CLI: `config` (a TOML file), the environment, then `settings` (sections as
        dicts, e.g. `model={"n_threads": 1}`); bad ones raise `SettingsError`."""
        from selfrag.infra.settings_loader import load_settings

        overrides = dict(settings)
        if home is not None:
            overrides["home"] = str(Path(home).expanduser())
        path = Path(config).expanduser() if config is not None else None
        return cls(load_settings(config_path=path, overrides=overrides))

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
        FileNotFoundError before anything is written."""
        for path in paths:
            if not Path(path).exists():
                raise FileNotFoundError(f"no such file or folder: {path}")
        store = self.system.for_collection(collection).store
        return [
            index_corpus(
                path,
                store,
                progress=progress,
                retrieval=self.settings.retrieval,
                follow_links=follow_links,
                threads=self.settings.model.n_threads or None,  # 0: every core
            )
            for path in paths
        ]

    def count(self, collection: str | None = None) -> int:
        """Passages in the index (of `collection`, default the configured one)."""
        return self.system.for_collection(collection).store.count()

    def documents(self, collection: str | None = None) -> list[DocumentInfo]:
        """The indexed documents: id, source file, title, passages, when indexed."""
        return self.system.for_collection(collection).store.documents()

    def remove(self, *refs: str | Path, collection: str | None = None) -> Removal:
        """Take documents out of the index: each ref a document id, or the file or folder
        they were indexed from. Their passages leave every search and no cached answer that
        cites them is served again (the index version changes)."""
        return self.system.for_collection(collection).store.remove([str(r) for r in refs])

    def precompute_kv(self, progress: bool = False) -> KVPrecompute:
        """Save every indexed passage's KV state to the disk tier (`HOME/kv`), so answers
        start warm, in every process of the node and after a restart. ValueError when the
        configuration has no disk tier."""
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
        return (await asyncio.to_thread(self.client.answer, request)).response

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
        return SegmentStream(self.client, request)

    def astream(
        self,
        question: str,
        *,
        max_tokens: int | None = None,
        collection: str | None = None,
        **dials: Any,
    ) -> SegmentStream:
        """`stream` for asyncio: `async for event in rag.astream(q)`, then `.response`."""
        request = AnswerRequest.of(question, max_tokens=max_tokens, collection=collection, **dials)
        return SegmentStream(self.client, request)

    def retrieve(
        self, query: str, *, top_k: int | None = None, critique: str | None = None
    ) -> list[RankedPassage]:
        """The `top_k` passages the store finds for `query` (default: the configured top_k),
        most relevant first by the critique's relevance read (s_rel), no answer drafted."""
        overrides = DecodingOverrides.model_validate({"top_k": top_k, "critique": critique})
        config = self.system.answer_path.dials(overrides)
        critic = self.system.critic(config.critique)
        return ranked_passages(query, self.system.store, critic, config.top_k)

    async def aretrieve(
        self, query: str, *, top_k: int | None = None, critique: str | None = None
    ) -> list[RankedPassage]:
        """`retrieve` without blocking the event loop."""
        return await asyncio.to_thread(self.retrieve, query, top_k=top_k, critique=critique)

    # --- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the answers still decoding (streams among them), then free the model, the
        store and the caches."""
        self.client.stop(self.CLOSE_WAIT_S)
        self.system.close()

    def __enter__(self) -> SelfRAG:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
