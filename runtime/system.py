"""Wires settings into a working Self-RAG system: engine, store, critique and decoder.

Components are built lazily, so `selfrag index` never loads the language model and
`selfrag config` loads nothing.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from selfrag.infra.engine.engine_threads import apply_wait_policy
from selfrag.infra.lifecycle import Closeable
from selfrag.pipeline.answerability_model import AnswerabilityError, AnswerabilityModel
from selfrag.pipeline.critics import (
    RESERVED_PIECES,
    Critic,
    CritiqueUnavailable,
    make_critic,
    with_answerability,
)
from selfrag.pipeline.critics.factory import auto_source
from selfrag.pipeline.critics.verify import VerifiedCritic
from selfrag.pipeline.decoder import StepListener
from selfrag.pipeline.heads import HeadsError, ReflectionHeads
from selfrag.runtime.answering import (
    Answer,
    AnswerPath,
    CacheIdentity,
    Deadline,
)
from selfrag.runtime.assembly import DecoderParts
from selfrag.runtime.calibrated import CalibratedDefaults
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.settings import COLLECTION_NAME, ModelSettings, Settings

log = logging.getLogger(__name__)
# The critique sources (all but `auto`): each may have an answerability model (part of the
# model's cache identity) and a calibrated support threshold (part of a settled config).
CRITIQUE_SOURCES = ("learned", "likelihood", "prompted", "native")

if TYPE_CHECKING:  # heavy modules (llama.cpp, Qdrant) load only when a component is built
    from selfrag.infra.cache.kv_cache import TieredStateStore
    from selfrag.infra.embeddings.embedder import SentenceEmbedder
    from selfrag.infra.engine.llama_engine import LlamaEngine
    from selfrag.infra.engine.vllm_engine import VLLMEngine
    from selfrag.infra.store.qdrant_store import QdrantStore


class LocalRuntime(Closeable):
    """The parts of Self-RAG in this process (engine, store, critics, decoder parts, answer path),
    built lazily from the settings. Thread-safe; the engine serialises its own calls."""

    def __init__(self, settings: Settings, *, layer_tap: bool | None = None) -> None:
        """`layer_tap`: whether the engine can read middle layers; None: when an answerability
        model of the model file reads one (the tap slows generation: docs/benchmarks.md,
        "Reading middle layers")."""
        self.settings = settings
        self._layer_tap = layer_tap
        settings.home.mkdir(parents=True, exist_ok=True)
        self._critics: dict[str, Critic] = {}
        self._lock = threading.Lock()
        self._siblings: dict[str, LocalRuntime] = {}

    # --- components -----------------------------------------------------------------------------

    @cached_property
    def embedder(self) -> SentenceEmbedder:
        from selfrag.infra.embeddings.embedder import SentenceEmbedder

        self._before_llama()  # an embedder may load llama.cpp (or torch's OpenMP) first
        if self.settings.model.backend == "llama_cpp":
            # A process loads one CPU backend, chosen by the first model it loads: let the chat
            # model choose it, since a backend the embedder runs on may crash the chat model
            # (an AMX build on a VM that reports AMX), not the other way round.
            from selfrag.infra.engine.llama_cpu_builds import ensure_backend

            ensure_backend(self.model_path, n_threads=self.settings.model.n_threads or 1)
        return SentenceEmbedder(self.settings.retrieval.embedding_model)

    @cached_property
    def store(self) -> QdrantStore:
        from selfrag.infra.store.qdrant_store import QdrantStore

        return QdrantStore.open(self.settings.retrieval, self.settings.home, self.embedder)

    def _before_llama(self) -> None:
        """Put OpenMP's wait policy (`model.omp_wait_policy`) into this process's environment:
        the runtime reads it once, when llama.cpp's CPU backend loads it. Called before
        anything here that may load llama.cpp: the embedder, the model file, the engine."""
        apply_wait_policy(self.settings.model.omp_wait_policy)

    @cached_property
    def model_path(self) -> Path:
        from selfrag.infra.models.model_files import derive_weights
        from selfrag.infra.models.model_presets import resolve_model

        self._before_llama()  # deriving weights loads llama.cpp
        source = resolve_model(self.settings.model, self.settings.home)
        return derive_weights(source, self.settings.model.weights, self.settings.home)

    @cached_property
    def model_fingerprint(self) -> str:
        """The model's identity in query-cache keys: its id, the GGUF file's SHA-256 (hashed
        once per file and process) and its reflection heads file's; a vLLM server's model has
        only its name."""
        if self.settings.model.backend == "vllm":
            return self.engine.model_id
        from selfrag.infra.models.model_files import file_sha256

        # The engine's model id, without loading the engine (the batch driver has none).
        model_id = model_id_for(self.settings.model, self.model_path)
        fingerprint = f"{model_id} sha256:{file_sha256(self.model_path)}"
        if self.heads_file is not None:
            # Retrained heads change the learned critique's answers.
            fingerprint += f" heads:{file_sha256(self.heads_file)}"
        if self.settings.model.support_read == "verify":
            return fingerprint + " support:verify"
        for source in CRITIQUE_SOURCES:
            # A fitted answerability model changes s_sup, hence abstentions.
            path = self.answerability_file(source)
            if path is not None:
                fingerprint += f" answerability-{source}:{file_sha256(path)}"
        return fingerprint

    @cached_property
    def engine(self) -> LlamaEngine | VLLMEngine:
        m = self.settings.model
        if m.backend == "vllm":
            from selfrag.infra.engine.vllm_engine import VLLMEngine

            if not m.vllm_url:
                raise ValueError("model.backend = 'vllm' needs model.vllm_url")
            return VLLMEngine(m.vllm_url, model=m.vllm_model, timeout_s=m.vllm_timeout_s)
        self._before_llama()
        from selfrag.infra.engine.llama_engine import LlamaEngine

        path = self.model_path
        return LlamaEngine(
            path,
            n_ctx=m.n_ctx,
            n_seq_max=m.n_seq_max,
            n_threads=m.n_threads,
            n_batch=m.n_batch,
            model_id=model_id_for(m, path),
            prefix_store=self.prefix_store,
            prefix_min_tokens=self.settings.cache.kv_min_tokens,
            layer_tap=self._layer_tap if self._layer_tap is not None else self.reads_layers,
            adaptive_threads=m.adaptive_threads,
        )

    @cached_property
    def reads_layers(self) -> bool:
        """Whether an answerability model of the model file probes a block's output (none
        is used while s_sup is the verification read)."""
        if self.settings.model.support_read == "verify":
            return False
        return any(
            (m := self.answerability(source)) is not None and m.blocks
            for source in CRITIQUE_SOURCES
        )

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
        from selfrag.infra.models.model_files import file_sha256

        return CalibratedDefaults(
            self.settings.home,
            lambda: file_sha256(self.model_path),
            lambda: self.model_fingerprint,
            self.settings.retrieval.collection,
        )

    def calibrated_filters(self, critique: str) -> dict[str, object]:
        """The filter defaults calibrated on the served collection for the critique source
        `critique` (`selfrag calibrate`); none on the vLLM backend (no model file to key by)."""
        if self.settings.model.backend == "vllm":
            return {}
        return self.calibrated.filters(critique)

    def critique_name(self, source: str) -> str:
        """The concrete critique source `source` stands for on this model: `auto` as
        `auto_source` decides, from the model file's header (reflection tokens) and whether it
        has a heads file, without loading llama.cpp; a vLLM server's model is asked."""
        if source != "auto":
            return source
        if self.settings.model.backend != "llama_cpp":
            return self.critic(source).name
        from selfrag.infra.models.model_files import gguf_special_tokens

        native = set(RESERVED_PIECES) <= gguf_special_tokens(self.model_path)
        name = auto_source(native=native, learned=self.heads_file is not None)
        if name == "likelihood":
            warn_missing_heads(self.model_path)
        return name

    @cached_property
    def heads_file(self) -> Path | None:
        """The reflection heads file of the model: configured, else trained here for the model
        file, else shipped for it; None without one (or on the vLLM backend)."""
        if self.settings.model.backend == "vllm":
            return None
        if self.settings.model.heads is not None:
            return self.settings.model.heads
        from selfrag.infra.models.heads_store import find_heads
        from selfrag.infra.models.model_files import file_sha256

        return find_heads(self.settings.home, file_sha256(self.model_path))

    @cached_property
    def heads(self) -> ReflectionHeads | None:
        """The heads in `heads_file`; heads of another model file are refused (`HeadsError`)."""
        if self.heads_file is None:
            return None
        from selfrag.infra.models.heads_store import load_heads
        from selfrag.infra.models.model_files import file_sha256, gguf_hidden_size

        heads = load_heads(self.heads_file)
        try:
            heads.check_model(file_sha256(self.model_path), gguf_hidden_size(self.model_path))
        except HeadsError as exc:
            raise HeadsError(f"{self.heads_file}: {exc}") from None
        return heads

    def answerability_file(self, source: str) -> Path | None:
        """The answerability model file of the model file and critique `source`: fitted here,
        else shipped; None without one, when `model.answerability` is off, or on vLLM."""
        if self.settings.model.backend == "vllm" or not self.settings.model.answerability:
            return None
        from selfrag.infra.models.heads_store import find_answerability
        from selfrag.infra.models.model_files import file_sha256

        return find_answerability(self.settings.home, file_sha256(self.model_path), source)

    def answerability(self, source: str) -> AnswerabilityModel | None:
        """The model in `answerability_file`; one of another model file or source is refused
        (`AnswerabilityError`)."""
        path = self.answerability_file(source)
        if path is None:
            return None
        from selfrag.infra.models.heads_store import load_answerability
        from selfrag.infra.models.model_files import file_sha256, gguf_hidden_size

        model = load_answerability(path)
        try:
            model.check(file_sha256(self.model_path), source, gguf_hidden_size(self.model_path))
        except AnswerabilityError as exc:
            raise AnswerabilityError(f"{path}: {exc}") from None
        return model

    def critic(self, source: str) -> Critic:
        """The critique `source` names on this model. `learned` without heads for the model file
        is `CritiqueUnavailable` saying so; `auto` without them is `likelihood`, with a warning
        logged once per process and model file."""
        with self._lock:
            if source not in self._critics:
                heads = self.heads if source in ("auto", "learned") else None
                llama = self.settings.model.backend == "llama_cpp"
                if source == "learned" and heads is None and llama:
                    raise CritiqueUnavailable(
                        f"critique 'learned' needs reflection heads for the model file "
                        f"{self.model_path.name}, and it has none: train them with `selfrag "
                        "train`, or use critique 'auto' or 'likelihood'"
                    )
                critic = make_critic(self.engine, source, self.settings.calibration, heads)
                if self.settings.model.support_read == "verify":
                    critic = VerifiedCritic(critic, self.engine)
                else:
                    answerability = self.answerability(critic.name)
                    critic = with_answerability(critic, self.engine, answerability)
                if source == "auto" and heads is None and llama and critic.name == "likelihood":
                    warn_missing_heads(self.model_path)
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

    def answer_config(
        self, question: str, config: DecodingConfig, on_step: StepListener | None = None
    ) -> Answer:
        """Answer with a settled config (`answer_path.config`), through the answer path."""
        return self.answer_path.run(
            question, config, self.decode, identity=self.cache_identity, on_step=on_step
        )

    def answer(self, request: AnswerRequest) -> AnswerResponse:
        return self.answer_config(request.question, self.answer_path.config(request)).response

    def precompute_kv(self, progress: bool = True, batch: int = 8) -> KVPrecompute:
        """Compute and save to the disk tier the KV state of every indexed passage's prompt
        head, as answers reuse it (a relevance call per passage; a state already saved is
        restored instead, so a second run is quick). Prints the disk it will take after the
        first batch."""
        import shutil
        import sys
        import time

        from tqdm import tqdm

        from selfrag.pipeline.critics import Branch

        store = self.prefix_store
        if self.settings.model.backend != "llama_cpp" or store is None or store.disk is None:
            raise ValueError(
                "--precompute-kv needs the llama.cpp backend, cache.passage_kv on and "
                "cache.kv_disk_mb > 0"
            )
        disk = store.disk
        passages = list(self.store.passages())
        critic = self.critic("auto")
        started, before = time.perf_counter(), disk.size_bytes()
        bar = tqdm(total=len(passages), unit="passage", disable=not progress)
        for start in range(0, len(passages), batch):
            chunk = passages[start : start + batch]
            critic.relevance([Branch(KV_WARM_QUESTION, "", p) for p in chunk])
            store.flush()
            bar.update(len(chunk))
            if start == 0 and progress:
                per = (disk.size_bytes() - before) / len(chunk)
                need, free = per * len(passages), shutil.disk_usage(disk.folder).free
                bar.write(
                    f"about {need / 2**20:,.0f} MiB for {len(passages)} passages "
                    f"({per / 2**20:.1f} MiB each; cap {disk.max_bytes / 2**20:,.0f} MiB, "
                    f"{free / 2**20:,.0f} MiB free)",
                    file=sys.stderr,
                )
                if need > disk.max_bytes:
                    bar.write(
                        "the cap is smaller: the least recently used states will go",
                        file=sys.stderr,
                    )
        bar.close()
        counters = store.counters()
        return KVPrecompute(
            passages=len(passages),
            computed=counters.get("put", 0),
            disk_bytes=disk.size_bytes(),
            seconds=time.perf_counter() - started,
        )

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
        for name in ("engine", "store", "prefix_store"):
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
            layer_tap=parent._layer_tap,
        )
        self._parent = parent
        self._critics = parent._critics
        self._lock = parent._lock

    @property  # type: ignore[override]
    def embedder(self) -> SentenceEmbedder:
        return self._parent.embedder

    @property  # type: ignore[override]
    def engine(self) -> LlamaEngine | VLLMEngine:
        return self._parent.engine

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


# Any question: what is saved is the prompt head before it (template + passage).
KV_WARM_QUESTION = "What does this passage say?"


@dataclass(frozen=True)
class KVPrecompute:
    """What `LocalRuntime.precompute_kv` did."""

    passages: int
    computed: int
    disk_bytes: int
    seconds: float


def model_id_for(model: ModelSettings, path: Path) -> str:
    """A readable model id: the preset's or the configured file's name, and the file the
    engine loads."""
    from selfrag.infra.models.model_presets import model_title

    return f"{model_title(model)} ({path.name})"


def missing_heads_message(model_file: Path) -> str:
    """What `auto` does on a model file without reflection heads, and how to give it some."""
    return (
        f"no reflection heads for the model file {model_file.name}: critique 'auto' falls back to "
        "'likelihood' (train heads for this file with `selfrag train` to use 'learned')"
    )


_warned_lock = threading.Lock()
_warned_files: set[Path] = set()


def warn_missing_heads(model_file: Path) -> None:
    """Log `missing_heads_message` (WARNING) once per process and model file."""
    with _warned_lock:
        if model_file in _warned_files:
            return
        _warned_files.add(model_file)
    log.warning("%s", missing_heads_message(model_file))
