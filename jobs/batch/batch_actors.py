"""The engine actors of `selfrag batch` and `selfrag eval --ray`, which answer a batch of
questions in threads; with the embedded store they search through the one store actor (a
`runtime.passage_service.PassageService`)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import TYPE_CHECKING, Any

from selfrag.pipeline.decoder import StepListener
from selfrag.runtime.answer_client import AnswerClient, AnswerSite, LocalAnswerClient
from selfrag.runtime.answering import (
    AnswerPath,
    CacheIdentity,
    Deadline,
)
from selfrag.runtime.assembly import DecoderParts
from selfrag.runtime.merging import MergedCritic
from selfrag.runtime.relevance import ranked_passages
from selfrag.runtime.remote_retriever import RemoteRetriever, actor_call
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import AnswerError
from selfrag.schemas.retrieval import RankedPassage, RetrievalOrder
from selfrag.schemas.settings import Settings

if TYPE_CHECKING:
    from selfrag.infra.store.qdrant_store import QdrantStore

# Seconds a critique call waits for the other decoder threads of its actor before it runs
# alone. The threads' searches queue at one retriever (a fraction of a second each),
# while a merged engine call takes seconds, so waiting for stragglers pays.
MERGE_WAIT_S = 0.3
# Seconds the store actor has to say which index it serves when an engine actor starts.
STORE_TIMEOUT_S = 120.0


class BatchAnswerer:
    """A Ray Data actor: one llama.cpp engine, and a thread per question of a batch."""

    def __init__(self, settings: Settings, retriever: Any | None, n_threads: int) -> None:
        from selfrag.runtime.engine_worker import EngineWorker

        if n_threads and not settings.model.n_threads:
            model = settings.model.model_copy(update={"n_threads": n_threads})
            settings = settings.model_copy(update={"model": model})
        self._worker = EngineWorker(settings, merge_wait_s=MERGE_WAIT_S)
        self._rag = self._worker.rag
        self._model_id = self._worker.engine.model_id
        self._retriever = retriever
        self._index_version = self._store(Deadline(STORE_TIMEOUT_S)).index_version()
        # The key the online endpoint uses too: a Redis shared with it serves both.
        self._path = AnswerPath.for_settings(settings, facts=self._rag)

    @cached_property
    def _client(self) -> AnswerClient:
        """The actor's answer client: the answer path around its merged-critic decode (and
        retrieval on the same store and merged critic)."""
        site = AnswerSite(self._path, self._decode, self._identity, self._retrieve)
        return LocalAnswerClient(lambda _collection: site)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        keys = [str(k) for k in batch["key"]]
        questions = [str(q) for q in batch["question"]]
        configs = [DecodingConfig.model_validate_json(str(c)) for c in batch["config"]]
        with ThreadPoolExecutor(len(keys), thread_name_prefix="selfrag-batch") as pool:
            results = list(pool.map(self._answer_one, questions, configs))
        return {"key": keys, "result": results}

    def _answer_one(self, question: str, config: DecodingConfig) -> str:
        """The outcome of one question, with the config the driver settled, as JSON:
        {status: ok, response, cache} or {status: error, error: {type, message}}."""
        try:
            request = AnswerRequest(question=question)
            answer = self._client.answer(request, config=config)
        except AnswerError as exc:
            return _error(exc.kind, exc.detail)
        except Exception as exc:  # any failure is this question's record, not the run's end
            return _error("internal_error", f"{type(exc).__name__}: {exc}")
        return _ok(answer.response, answer.cache)

    def _store(self, deadline: Deadline) -> RemoteRetriever | QdrantStore:
        """The passages: through the store actor within `deadline` when there is one (this
        actor then never opens the store itself: an embedded folder takes one process), else
        this actor's own store."""
        if self._retriever is not None:
            return RemoteRetriever(actor_call(self._retriever, deadline))
        return self._rag.store

    def _identity(self) -> CacheIdentity:
        # Hashes the model file once per actor, and only when answers are cached.
        return CacheIdentity(self._index_version, self._rag.model_fingerprint)

    def _decode(
        self,
        question: str,
        config: DecodingConfig,
        deadline: Deadline,
        on_step: StepListener | None,
    ) -> AnswerResponse:
        store = self._store(deadline)

        def decode(critic: MergedCritic) -> AnswerResponse:
            parts = DecoderParts(lambda _source: critic, store, self._model_id)
            return parts.decode(question, config, on_step)

        return self._worker.run(config.critique, deadline, decode)

    def _retrieve(
        self, query: str, config: DecodingConfig, order: RetrievalOrder
    ) -> list[RankedPassage]:
        deadline = Deadline(config.timeout_s)
        store = self._store(deadline)

        def rank(critic: MergedCritic) -> list[RankedPassage]:
            relevance = critic.relevance if order == "relevance" else None
            return ranked_passages(query, store, config.top_k, relevance)

        return self._worker.run(config.critique, deadline, rank)


def _ok(response: AnswerResponse, cache: str) -> str:
    body = response.model_dump(mode="json")
    return json.dumps({"status": "ok", "cache": cache, "response": body})


def _error(kind: str, message: str) -> str:
    return json.dumps({"status": "error", "error": {"type": kind, "message": message}})
