"""Wires settings into a working Self-RAG system: model, store, critique and decoder.

Components are built lazily, so `selfrag index` never loads the language model and
`selfrag config` loads nothing.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

from selfrag.infra.lifecycle import Closeable
from selfrag.pipeline.critics import Critic, make_critic, with_answerability
from selfrag.pipeline.critics.verify import VerifiedCritic
from selfrag.pipeline.decoder import StepListener
from selfrag.runtime.answering import (
    AnswerPath,
    CacheIdentity,
    Deadline,
)
from selfrag.runtime.assembly import DecoderParts
from selfrag.runtime.calibrated import CalibratedDefaults
from selfrag.runtime.model_artefacts import ModelArtefacts, model_artefacts, open_embedder
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.settings import COLLECTION_NAME, Settings

if TYPE_CHECKING:  # heavy modules (llama.cpp, Qdrant) load only when a component is built
    from selfrag.infra.cache.kv_cache import TieredStateStore
    from selfrag.infra.embeddings.embedder import SentenceEmbedder
    from selfrag.infra.engine.llama_engine import LlamaEngine
    from selfrag.infra.engine.vllm_engine import VLLMEngine
    from selfrag.infra.store.qdrant_store import QdrantStore


class FirstUseCalibration(Protocol):
    """What calibrates a support threshold the first time a runtime settles a request for a
    critique source without one (`jobs.first_use.calibrate_on_first_use`)."""

    def __call__(self, runtime: LocalRuntime, critique: str) -> bool:
        """Calibrate the threshold of `critique` on `runtime`'s collection if it has none and
        the settings allow it; whether one was written."""
        ...


def open_store(settings: Settings, embedder: SentenceEmbedder) -> QdrantStore:
    """The passage store of `settings`, searched with `embedder`: where every process opens
    one (`LocalRuntime.store`, `PassageService`)."""
    from selfrag.infra.store.qdrant_store import QdrantStore

    return QdrantStore.open(settings.retrieval, settings.home, embedder)


class LocalRuntime(Closeable):
    """The parts of Self-RAG in this process (model, store, critics, decoder parts, answer
    path), built lazily from the settings. Thread-safe; the engine serialises its own calls."""

    def __init__(
        self,
        settings: Settings,
        *,
        layer_tap: bool | None = None,
        first_use: FirstUseCalibration | None = None,
    ) -> None:
        """`layer_tap`: whether the engine can read middle layers; None: when an answerability
        model of the model file reads one (`model_artefacts`). `first_use`: what calibrates a
        missing support threshold when a request first settles for its critique source, in a
        process that owns the store (the Python API, the CLI, batch and evaluation drivers);
        None: a missing one leaves the filter off (Serve's replicas, which only read)."""
        self.settings = settings
        self._layer_tap = layer_tap
        settings.home.mkdir(parents=True, exist_ok=True)
        self._critics: dict[str, Critic] = {}
        self._lock = threading.Lock()
        self._siblings: dict[str, LocalRuntime] = {}
        self._first_use = first_use
        # Re-entrant: the calibration's own settling must not start it again.
        self._first_use_lock = threading.RLock()
        self._first_use_tried: set[str] = set()
        self._calibrating: dict[str, int] = {}  # source: calibrations of it running here

    # --- components -----------------------------------------------------------------------------

    @cached_property
    def model(self) -> ModelArtefacts:
        """The model's file, identity, heads, answerability models and engine."""
        return model_artefacts(
            self.settings, layer_tap=self._layer_tap, prefix_store=lambda: self.prefix_store
        )

    @cached_property
    def embedder(self) -> SentenceEmbedder:
        return open_embedder(self.settings, self.model)

    @cached_property
    def store(self) -> QdrantStore:
        return open_store(self.settings, self.embedder)

    @property
    def engine(self) -> LlamaEngine | VLLMEngine:
        return self.model.engine

    @property
    def model_fingerprint(self) -> str:
        """The model's identity in query-cache keys (`ModelArtefacts.fingerprint`)."""
        return self.model.fingerprint

    @cached_property
    def prefix_store(self) -> TieredStateStore | None:
        """The passage KV-state store (memory LRU, then Redis when configured), or None."""
        from selfrag.infra.cache.kv_cache import open_prefix_store

        return open_prefix_store(self.settings)

    def kv_store_counters(self) -> Mapping[str, int]:
        """The passage KV-state store's tier counters; empty while none was opened."""
        store = self.__dict__.get("prefix_store")  # never opens one just to report on it
        return store.counters() if store is not None else {}

    @cached_property
    def parts(self) -> DecoderParts:
        """This process's decoder parts: its critique sources, store and engine."""
        return DecoderParts(self.critic, self.store, self.engine.model_id)

    @cached_property
    def calibrated(self) -> CalibratedDefaults:
        """The support thresholds calibrated on this runtime's collection for the model file."""
        return CalibratedDefaults(
            self.settings.home,
            lambda: self.model.sha256,
            lambda: self.model.fingerprint,
            self.settings.retrieval.collection,
        )

    def calibrated_filters(self, critique: str) -> dict[str, object]:
        """The filter defaults calibrated on the served collection for the critique source
        `critique` (`selfrag calibrate`, or on first use here); none for a model without a
        file to key them by."""
        if critique in self._calibrating:
            # Being calibrated: by this thread (the calibration's own reads), which must find
            # none and start none; or by a first use in another, which this waits for.
            with self._first_use_lock:
                if critique in self._calibrating and self.calibrated.calibration(critique) is None:
                    return {}
        self._calibrate_on_first_use(critique)
        return self.model.calibrated_filters(self.calibrated, critique)

    def _calibrate_on_first_use(self, critique: str) -> None:
        """`first_use` for `critique`, once per runtime and source; other threads settling
        meanwhile wait for it, so none answers with the filter off while it runs."""
        if self._first_use is None:
            return
        with self._first_use_lock:
            if critique in self._first_use_tried:
                return
            self._first_use_tried.add(critique)
            try:
                self._first_use(self, critique)
            except BaseException:
                self._first_use_tried.discard(critique)  # the next request tries again
                raise

    @contextmanager
    def calibrating(self, critique: str) -> Iterator[None]:
        """Mark the concrete source `critique` as being calibrated here (`selfrag index`,
        `selfrag calibrate`, a first use): the calibration settles its reads' config, which
        must neither start a second calibration of the source nor warn that it has none."""
        with self._first_use_lock:
            self._calibrating[critique] = self._calibrating.get(critique, 0) + 1
        try:
            yield
        finally:
            with self._first_use_lock:
                self._calibrating[critique] -= 1
                if not self._calibrating[critique]:
                    del self._calibrating[critique]

    def critique_name(self, source: str) -> str:
        """The concrete critique source `source` stands for on this model: `auto` as the model
        artefacts tell (`ModelArtefacts.auto_critique`), else as its critic says."""
        if source != "auto":
            return source
        name = self.model.auto_critique()
        return name if name is not None else self.critic(source).name

    def critic(self, source: str) -> Critic:
        """The critique `source` names on this model (`CritiqueUnavailable` when it cannot run
        there), its s_sup the verification read or the source's answerability model."""
        with self._lock:
            if source not in self._critics:
                model = self.model
                heads = model.critique_heads(source)
                critic = make_critic(model.engine, source, self.settings.calibration, heads)
                if self.settings.model.support_read == "verify":
                    critic = VerifiedCritic(critic, model.engine)
                else:
                    answerability = model.answerability(critic.name)
                    critic = with_answerability(critic, model.engine, answerability)
                model.note_critic(source, critic)
                self._critics[source] = critic
            return self._critics[source]

    # --- operations -----------------------------------------------------------------------------

    @cached_property
    def answer_path(self) -> AnswerPath:
        """The answer path of this process (`AnswerPath.for_settings`), settling configs with
        this runtime's critique facts."""
        return AnswerPath.for_settings(self.settings, facts=self)

    def cache_identity(self) -> CacheIdentity:
        return CacheIdentity(self.store.index_version(), self.model_fingerprint)

    def decode(
        self,
        question: str,
        config: DecodingConfig,
        deadline: Deadline,
        on_step: StepListener | None = None,
    ) -> AnswerResponse:
        """Decode in this process (the decoder keeps to `config.timeout_s` itself)."""
        return self.parts.decode(question, config, on_step)

    def for_collection(self, name: str | None) -> LocalRuntime:
        """This runtime on the collection `name` of the home (None: its own): a store of its
        own, and with it its own index version, query-cache scope and support calibration;
        the same model, embedder, critics and KV states. Closed with this one."""
        if name is None or name == self.settings.retrieval.collection:
            return self
        with self._lock:
            if name not in self._siblings:
                self._siblings[name] = CollectionRuntime(self, name)
            return self._siblings[name]

    def close(self) -> None:
        for sibling in self._siblings.values():
            sibling.close()
        self._siblings.clear()
        for name in ("model", "store", "prefix_store"):  # the model closes its engine
            component = self.__dict__.pop(name, None)
            if component is not None:
                component.close()


class CollectionRuntime(LocalRuntime):
    """A `LocalRuntime` on another collection of the same home (`for_collection`): its own
    store, answer path, decoder parts and calibrations (`calibrated`: this collection's); the
    model, embedder, critics and KV-state store of the runtime it came from, which closes it."""

    def __init__(self, parent: LocalRuntime, collection: str) -> None:
        if not re.fullmatch(COLLECTION_NAME, collection):
            raise ValueError(
                f"collection {collection[:80]!r}: letters, digits, '_', '.' and '-' only, "
                "64 at most, starting with a letter or digit"
            )
        retrieval = parent.settings.retrieval.model_copy(update={"collection": collection})
        super().__init__(
            parent.settings.model_copy(update={"retrieval": retrieval}),
            first_use=parent._first_use,
        )
        self._parent = parent
        self._critics = parent._critics
        self._lock = parent._lock

    @property  # type: ignore[override]
    def embedder(self) -> SentenceEmbedder:
        return self._parent.embedder

    @property  # type: ignore[override]
    def model(self) -> ModelArtefacts:
        return self._parent.model

    @property  # type: ignore[override]
    def prefix_store(self) -> TieredStateStore | None:
        return self._parent.prefix_store

    @cached_property
    def calibrated(self) -> CalibratedDefaults:
        return self._parent.calibrated.for_collection(self.settings.retrieval.collection)

    def for_collection(self, name: str | None) -> LocalRuntime:
        return self._parent.for_collection(name or self.settings.retrieval.collection)

    def close(self) -> None:
        """Close its store only: the rest is the parent's."""
        store = self.__dict__.pop("store", None)
        if store is not None:
            store.close()
