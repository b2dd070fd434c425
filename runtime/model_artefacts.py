"""A model's artefacts behind one object: its file, its identity in query-cache keys, its
reflection heads and answerability models, the critique source `auto` stands for on it, and its
engine. `GGUFModel` is a GGUF file run by llama.cpp in this process; `VLLMServerModel` is the
model a vLLM server runs. `model_artefacts` picks one for the settings; nothing else asks
which backend a model runs on.

Everything is built lazily, so `selfrag index` never loads the language model.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from selfrag.infra.engine.engine_threads import apply_wait_policy
from selfrag.infra.lifecycle import Closeable
from selfrag.pipeline.answerability_model import AnswerabilityError, AnswerabilityModel
from selfrag.pipeline.critics import RESERVED_PIECES, Critic, CritiqueUnavailable
from selfrag.pipeline.critics.factory import auto_source
from selfrag.pipeline.critics.verify import verified_support_id
from selfrag.pipeline.heads import HeadsError, ReflectionHeads
from selfrag.pipeline.scoring import SUPPORT_THRESHOLD_SCORE
from selfrag.schemas.decoding import CRITIQUE_SOURCES
from selfrag.schemas.settings import ModelSettings, Settings

if TYPE_CHECKING:  # heavy modules (llama.cpp) load only when the engine is built
    from selfrag.infra.cache.kv_cache import TieredStateStore
    from selfrag.infra.embeddings.embedder import SentenceEmbedder
    from selfrag.infra.engine.llama_engine import LlamaEngine
    from selfrag.infra.engine.vllm_engine import VLLMEngine
    from selfrag.runtime.calibrated import CalibratedDefaults

log = logging.getLogger(__name__)


def model_artefacts(
    settings: Settings,
    *,
    layer_tap: bool | None = None,
    prefix_store: Callable[[], TieredStateStore | None] = lambda: None,
) -> ModelArtefacts:
    """The artefacts of `settings.model` on its backend. `layer_tap`: whether the engine can
    read middle layers; None: when an answerability model of the model file reads one (the tap
    slows generation: notes/benchmarks.md, "Reading middle layers"). `prefix_store`: the
    passage KV-state store the engine saves states to, asked for when the engine is built."""
    kind = VLLMServerModel if settings.model.backend == "vllm" else GGUFModel
    return kind(settings, layer_tap=layer_tap, prefix_store=prefix_store)


def open_embedder(settings: Settings, model: ModelArtefacts | None = None) -> SentenceEmbedder:
    """The embedder of `settings.retrieval`, loaded once `model` (default: the settings'
    model) has prepared this process for llama.cpp (`ModelArtefacts.before_embedder`)."""
    from selfrag.infra.embeddings.embedder import SentenceEmbedder

    (model or model_artefacts(settings)).before_embedder()
    retrieval = settings.retrieval
    return SentenceEmbedder(retrieval.embedding_model, fmt=retrieval.embedding_format)


class ModelArtefacts(Closeable, ABC):
    """What a model is made of, found from the settings and built lazily; closing it closes
    its engine. Thread-safe as far as `cached_property` is (the engine serialises its own
    calls)."""

    def __init__(
        self,
        settings: Settings,
        *,
        layer_tap: bool | None = None,
        prefix_store: Callable[[], TieredStateStore | None] = lambda: None,
    ) -> None:
        self.settings = settings
        self._layer_tap = layer_tap
        self._prefix_store = prefix_store

    def _before_llama(self) -> None:
        """Put OpenMP's wait policy (`model.omp_wait_policy`) into this process's environment:
        the runtime reads it once, when llama.cpp's CPU backend loads it. Called before
        anything here that may load llama.cpp: the embedder, the model file, the engine."""
        apply_wait_policy(self.settings.model.omp_wait_policy)

    def before_embedder(self) -> None:
        """Prepare this process before the embedder loads llama.cpp (or torch's OpenMP)."""
        self._before_llama()

    @cached_property
    def path(self) -> Path:
        """The model file: the preset's or configured file, in the configured weights."""
        from selfrag.infra.models.model_files import derive_weights
        from selfrag.infra.models.model_presets import resolve_model

        self._before_llama()  # deriving weights loads llama.cpp
        source = resolve_model(self.settings.model, self.settings.home)
        return derive_weights(source, self.settings.model.weights, self.settings.home)

    @property
    def sha256(self) -> str:
        """The model file's SHA-256 (`file_sha256`: hashed once per file and process)."""
        from selfrag.infra.models.model_files import file_sha256

        return file_sha256(self.path)

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """The model's identity in query-cache keys."""

    @property
    @abstractmethod
    def engine(self) -> LlamaEngine | VLLMEngine:
        """The engine that runs the model, opened on first use."""

    @cached_property
    def heads_file(self) -> Path | None:
        """The reflection heads file of the model; None without one."""
        return None

    @cached_property
    def heads(self) -> ReflectionHeads | None:
        """The heads in `heads_file`; heads of another model file are refused (`HeadsError`)."""
        if self.heads_file is None:
            return None
        from selfrag.infra.models.heads_store import load_heads
        from selfrag.infra.models.model_files import gguf_hidden_size

        heads = load_heads(self.heads_file)
        try:
            heads.check_model(self.sha256, gguf_hidden_size(self.path))
        except HeadsError as exc:
            raise HeadsError(f"{self.heads_file}: {exc}") from None
        return heads

    def answerability_file(self, source: str) -> Path | None:
        """The answerability model file of the model and critique `source`; None without one."""
        return None

    def answerability(self, source: str) -> AnswerabilityModel | None:
        """The model in `answerability_file`; one of another model file or source is refused
        (`AnswerabilityError`)."""
        path = self.answerability_file(source)
        if path is None:
            return None
        from selfrag.infra.models.heads_store import load_answerability
        from selfrag.infra.models.model_files import gguf_hidden_size

        model = load_answerability(path)
        try:
            model.check(self.sha256, source, gguf_hidden_size(self.path))
        except AnswerabilityError as exc:
            raise AnswerabilityError(f"{path}: {exc}") from None
        return model

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

    def auto_critique(self, *, warn: bool = True) -> str | None:
        """The critique source `auto` stands for, when the artefacts tell without an engine;
        None when only the model's critic can say."""
        return None

    def critique_heads(self, source: str) -> ReflectionHeads | None:
        """The heads a critic of `source` reads (`auto` and `learned` only)."""
        return self.heads if source in ("auto", "learned") else None

    def check_critique(self, source: str) -> None:
        """Read the files a critic of the concrete `source` reads (its reflection heads, its
        answerability model), without an engine: a malformed or mismatched one is a
        `HeadsError` or `AnswerabilityError` naming it and what to do, here rather than in
        every answer."""
        self.critique_heads(source)
        if self.settings.model.support_read != "verify":
            self.answerability(source)

    def note_critic(self, source: str, critic: Critic) -> None:
        """Called with each critic built for `source` on this model."""

    def calibrated_filters(
        self, calibrated: CalibratedDefaults, critique: str
    ) -> dict[str, object]:
        """The filter defaults `calibrated` holds for the critique source `critique`."""
        return {}

    def close(self) -> None:
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.close()


class GGUFModel(ModelArtefacts):
    """A GGUF model file run by llama.cpp in this process, with the reflection heads and
    answerability models trained (or shipped) for that file."""

    def before_embedder(self) -> None:
        """A process loads one CPU backend, chosen by the first model it loads: let the chat
        model choose it, since a backend the embedder runs on may crash the chat model (an AMX
        build on a VM that reports AMX), not the other way round."""
        from selfrag.infra.engine.cpu_builds.llama_cpu_builds import ensure_backend

        super().before_embedder()
        ensure_backend(self.path, n_threads=self.settings.model.n_threads or 1)

    @cached_property
    def fingerprint(self) -> str:
        """The engine's model id, the GGUF file's SHA-256, its reflection heads file's and its
        answerability models' or the verified support's id (question and grounding rule; each
        changes the answers), and what the support threshold is compared with, without loading
        the engine (the batch driver has none)."""
        from selfrag.infra.models.model_files import file_sha256

        fingerprint = f"{model_id_for(self.settings.model, self.path)} sha256:{self.sha256}"
        if self.heads_file is not None:
            fingerprint += f" heads:{file_sha256(self.heads_file)}"
        if self.settings.model.support_read == "verify":
            fingerprint += f" support:verify:{verified_support_id()}"
        else:
            for source in CRITIQUE_SOURCES:
                path = self.answerability_file(source)
                if path is not None:
                    fingerprint += f" answerability-{source}:{file_sha256(path)}"
        return f"{fingerprint} {SUPPORT_THRESHOLD_SCORE}"

    @cached_property
    def engine(self) -> LlamaEngine:
        self._before_llama()
        from selfrag.infra.engine.llama_engine import LlamaEngine

        m, path = self.settings.model, self.path
        return LlamaEngine(
            path,
            n_ctx=m.n_ctx,
            n_seq_max=m.n_seq_max,
            n_threads=m.n_threads,
            n_batch=m.n_batch,
            model_id=model_id_for(m, path),
            prefix_store=self._prefix_store(),
            prefix_min_tokens=self.settings.cache.kv_min_tokens,
            layer_tap=self._layer_tap if self._layer_tap is not None else self.reads_layers,
            adaptive_threads=m.adaptive_threads,
        )

    @cached_property
    def heads_file(self) -> Path | None:
        """Configured, else trained here for the model file, else shipped for it."""
        if self.settings.model.heads is not None:
            return self.settings.model.heads
        from selfrag.infra.models.heads_store import find_heads

        return find_heads(self.settings.home, self.sha256)

    def answerability_file(self, source: str) -> Path | None:
        """Fitted here, else shipped; None without one or when `model.answerability` is off."""
        if not self.settings.model.answerability:
            return None
        from selfrag.infra.models.heads_store import find_answerability

        return find_answerability(self.settings.home, self.sha256, source)

    @cached_property
    def has_reflection_tokens(self) -> bool:
        """Whether the model file's vocabulary holds the reflection tokens (critique
        `native`), read from its GGUF header without loading llama.cpp."""
        from selfrag.infra.models.model_files import gguf_special_tokens

        return set(RESERVED_PIECES) <= gguf_special_tokens(self.path)

    def auto_critique(self, *, warn: bool = True) -> str:
        """As `auto_source` decides, from the model file's header (reflection tokens) and
        whether it has a heads file, without loading llama.cpp; falling back to likelihood
        is logged unless `warn` is False (a report that says it itself)."""
        native, learned = self.has_reflection_tokens, self.heads_file is not None
        name = auto_source(native=native, learned=learned)
        if name == "likelihood" and warn:
            warn_missing_heads(self.path)
        return name

    def critique_heads(self, source: str) -> ReflectionHeads | None:
        """`learned` without heads for the model file is `CritiqueUnavailable` saying so."""
        heads = super().critique_heads(source)
        if source == "learned" and heads is None:
            raise CritiqueUnavailable(
                f"critique 'learned' needs reflection heads for the model file "
                f"{self.path.name}, and it has none: train them with `selfrag "
                "train`, or use critique 'auto' or 'likelihood'"
            )
        return heads

    def note_critic(self, source: str, critic: Critic) -> None:
        """`auto` without heads is `likelihood`, with a warning logged once per process and
        model file."""
        if source == "auto" and self.heads is None and critic.name == "likelihood":
            warn_missing_heads(self.path)

    def calibrated_filters(
        self, calibrated: CalibratedDefaults, critique: str
    ) -> dict[str, object]:
        return calibrated.filters(critique)


class VLLMServerModel(ModelArtefacts):
    """The model a vLLM server runs: only its name is known here (no heads, no answerability
    models, no calibrations: no model file to key them by); its critic says what `auto` is."""

    @cached_property
    def fingerprint(self) -> str:
        """The served model's name."""
        return self.engine.model_id

    @cached_property
    def engine(self) -> VLLMEngine:
        from selfrag.infra.engine.vllm_engine import VLLMEngine

        m = self.settings.model
        if not m.vllm_url:
            raise ValueError("model.backend = 'vllm' needs model.vllm_url")
        return VLLMEngine(m.vllm_url, model=m.vllm_model, timeout_s=m.vllm_timeout_s)


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
