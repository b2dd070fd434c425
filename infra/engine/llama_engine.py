"""`LanguageModel` on llama.cpp's low-level API: multi-sequence batches and a KV prefix cache.

One llama.cpp context holds up to `n_seq_max` sequences ("slots") in a unified KV cache of
`n_ctx` cells. Every batched call decodes all of its requests together (several seq_ids per
`llama_decode`). The token prefix common to a batch is decoded once and shared with
`llama_memory_seq_cp`, which in a unified cache only tags the existing cells with another
sequence id. Across calls the engine remembers what every slot holds, so a request that
extends an earlier prompt (or an earlier prompt plus its generation) decodes only the new tokens.

With a `PrefixStateStore` the engine also keeps the KV state of each request's reusable prefix
(template + passage, `reusable_prefix`) across contexts and processes: it restores a saved
state into a slot instead of decoding the prefix, and saves the state after computing it.

The parts with a job of their own live beside it: the three batched calls' requests turned
into KV jobs and their results read back (`infra.engine.llama_calls`), the context's slot
planner, batch decoder and prefix stager, and the prefill and greedy generation of the groups of
jobs the planner sizes (`infra.engine.llama_groups`), the ctypes batch and the reads of its
outputs (`infra.engine.llama_batch`), prefix staging from the store (`infra.engine.kv_staging`),
slot planning (`infra.engine.kv_slots`), the vocabulary and token-id checks
(`infra.engine.llama_vocab`), the counters (`infra.engine.engine_stats`), the thread count of
each call (`infra.engine.llama_threads`), the context's parameters and KV-memory handle
(`infra.engine.llama_context`), and the CPU build loaded before the model
(`infra.engine.cpu_builds`). What stays here is the public API: loading, the lock, the three
batched calls, and the model's facts.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import llama_cpp

from selfrag.infra.cache.kv_cache import ContextLayout, PrefixStateStore
from selfrag.infra.engine.cpu_builds.llama_cpu_builds import ensure_backend
from selfrag.infra.engine.engine_stats import EngineStats
from selfrag.infra.engine.kv_slots import Slot
from selfrag.infra.engine.llama_batch import EngineError
from selfrag.infra.engine.llama_calls import (
    continuation_jobs,
    continuation_scores,
    generation_jobs,
    generations,
    next_token_scores,
    token_score_jobs,
)
from selfrag.infra.engine.llama_context import check_sizes, context_params
from selfrag.infra.engine.llama_groups import GroupRunner
from selfrag.infra.engine.llama_layers import LayerTap
from selfrag.infra.engine.llama_threads import ThreadChooser
from selfrag.infra.engine.llama_vocab import LlamaVocab
from selfrag.infra.lifecycle import Closeable
from selfrag.infra.models.model_files import check_gguf, file_sha256
from selfrag.pipeline.protocols import (
    ContinuationRequest,
    ContinuationScores,
    Generation,
    GenerationRequest,
    TokenScoreRequest,
    TokenScores,
)

logger = logging.getLogger(__name__)


class LlamaEngine(Closeable):
    """A llama.cpp model with batched scoring, batched greedy generation and a prefix cache.

    The model is loaded in the calling process; use one engine per process (no fork after load).
    Every public batched call holds the engine's lock, so threads may share one engine.
    """

    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int,
        n_seq_max: int,
        n_threads: int,
        n_batch: int,
        model_id: str,
        prefix_cache: bool = True,
        share_prefix: bool = True,
        prefix_store: PrefixStateStore | None = None,
        model_sha256: str | None = None,
        prefix_min_tokens: int = 32,
        layer_tap: bool = False,
        adaptive_threads: bool = True,
    ) -> None:
        """`adaptive_threads`: run small decode calls on one thread where that measures
        faster (`infra.engine.llama_threads`); False: every call on all `n_threads`."""
        check_sizes(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, n_threads=n_threads)
        check_gguf(model_path)
        threads = n_threads or os.cpu_count() or 1
        # Probes the model in a child process first: an unusable CPU feature must not kill us.
        ensure_backend(model_path, n_threads=threads)
        self._model_id = model_id
        self.model_path = model_path
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._ctx: llama_cpp.llama_context_p | None = None
        self._model: llama_cpp.llama_model_p | None = None

        self._load_model(model_path)

        ctx_params = context_params(
            n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, threads=threads
        )
        # The eval callback is asked about every graph node of every decode, so it is only
        # installed for an engine whose critique reads a middle layer.
        self._tap = LayerTap() if layer_tap else None
        if self._tap is not None:
            ctx_params.cb_eval = self._tap.callback
        self._open_context(ctx_params, f"(n_ctx={n_ctx}, n_seq_max={n_seq_max}, n_batch={n_batch})")
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self.n_seq_max = n_seq_max
        self.n_threads = threads
        self._groups = GroupRunner(
            self._ctx,
            ctx_params,
            vocab=self._vocab,
            n_embd=self._n_embd,
            tap=self._tap,
            threads=ThreadChooser(threads, adaptive=adaptive_threads),
            prefix_cache=prefix_cache,
            share_prefix=share_prefix,
            model_sha256=model_sha256,
            prefix_min_tokens=prefix_min_tokens,
        )
        self.prefix_store = prefix_store

    def _load_model(self, model_path: Path) -> None:
        """Load the weights, with their vocabulary, embedding width, depth and chat template."""
        model_params = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), model_params)
        if not self._model:
            self._model = None
            raise EngineError(f"llama.cpp could not load the model file {model_path}")
        self._vocab = LlamaVocab(llama_cpp.llama_model_get_vocab(self._model))
        self._n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self._n_layers = int(llama_cpp.llama_model_n_layer(self._model))
        self._chat_template = self._meta_str("tokenizer.chat_template")

    def _open_context(self, ctx_params: llama_cpp.llama_context_params, sizes: str) -> None:
        """Create the context; when llama.cpp cannot, free the model and say which `sizes`."""
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            self._ctx = None
            self.close()
            raise EngineError(f"llama.cpp could not create a context {sizes} for {self.model_path}")

    @property
    def slots(self) -> Sequence[Slot]:
        """What each KV sequence holds now (for inspection; the planner owns them)."""
        return self._groups.planner.slots

    @property
    def prefix_cache(self) -> bool:
        """Whether slots keep their content across calls (off: every call starts empty)."""
        return self._groups.planner.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, on: bool) -> None:
        self._groups.planner.prefix_cache = on

    @property
    def share_prefix(self) -> bool:
        """Whether a call's common prefix is decoded once and shared (`seq_cp`)."""
        return self._groups.planner.share_prefix

    @share_prefix.setter
    def share_prefix(self, on: bool) -> None:
        self._groups.planner.share_prefix = on

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Free the batch, the context and the model once the call in progress (if any) has
        ended; later calls raise. Safe to call twice."""
        if getattr(self, "_pid", os.getpid()) != os.getpid():
            # In a forked child the native objects belong to the parent: just let go of them.
            groups = getattr(self, "_groups", None)
            if groups is not None:
                groups.decoder.forget()
            self._ctx = self._model = None
            return
        lock = getattr(self, "_lock", None)  # absent when __init__ failed early
        if lock is None:
            self._free()
            return
        with lock:  # freeing under a running decode would crash the process
            self._free()

    def _free(self) -> None:
        groups = getattr(self, "_groups", None)
        if groups is not None:
            groups.decoder.free()
        if getattr(self, "_ctx", None) is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None) is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ----------------------------------------------------------------- model facts

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def model_sha256(self) -> str | None:
        """SHA-256 of the model file, part of every prefix-state key (None without a store)."""
        return self._groups.model_sha256

    @property
    def layout(self) -> ContextLayout:
        """What a saved sequence state of this context needs in order to restore elsewhere."""
        return self._groups.layout

    @property
    def prefix_store(self) -> PrefixStateStore | None:
        """Where reusable prefixes' KV states are restored from and saved to."""
        return self._groups.prefix_store

    @prefix_store.setter
    def prefix_store(self, store: PrefixStateStore | None) -> None:
        with self._lock:
            if store is not None and self._groups.model_sha256 is None:
                self._groups.model_sha256 = file_sha256(self.model_path)
            self._groups.prefix_store = store

    @property
    def prefix_min_tokens(self) -> int:
        """The shortest reusable prefix whose state is saved and restored."""
        return self._groups.prefix_min_tokens

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def n_vocab(self) -> int:
        return self._vocab.n_tokens

    @property
    def hidden_size(self) -> int | None:
        """Length of the hidden states `next_token_logprobs` returns on request."""
        return self._n_embd

    @property
    def n_layers(self) -> int | None:
        """The model's number of blocks when this engine can read their outputs (layer_tap)."""
        return self._n_layers if self._tap is not None else None

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the work counters."""
        with self._lock:
            return self._groups.stats.copy()

    def reset_stats(self) -> None:
        with self._lock:
            self._groups.stats.reset()

    @property
    def adaptive_threads(self) -> bool:
        """Whether small decode calls may run on one thread (`infra.engine.llama_threads`)."""
        return self._groups.decoder.threads.adaptive

    @adaptive_threads.setter
    def adaptive_threads(self, on: bool) -> None:
        with self._lock:
            self._groups.decoder.threads.adaptive = on

    def thread_choice(self) -> dict[int, int]:
        """The threads small decode calls run on now, by call size (`ThreadChooser.chosen`)."""
        with self._lock:
            return self._groups.decoder.threads.chosen()

    def clear_cache(self) -> None:
        """Forget every cached sequence (the next call starts from an empty KV cache)."""
        with self._lock:
            self._require_open()
            self._groups.planner.clear()

    def _meta_str(self, key: str) -> str | None:
        size = 4096
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    # ----------------------------------------------------------------- tokenizer

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Tokenize without adding BOS. With `special=False` no control token can appear."""
        self._require_open()
        return self._vocab.tokenize(text, special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of `tokens`, special tokens written out as their text."""
        self._require_open()
        return self._vocab.detokenize(self._vocab.check_tokens(tokens, "tokens"))

    def special_token_id(self, piece: str) -> int | None:
        """The id of `piece` when the vocabulary holds it as one control/user-defined token."""
        self._require_open()
        return self._vocab.special_token_id(piece)

    def bos_tokens(self) -> list[int]:
        """[BOS] when the model's vocabulary asks for it at the start of a prompt, else []."""
        self._require_open()
        return self._vocab.bos_tokens()

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, end-of-turn, ...)."""
        return self._vocab.is_eog(token)

    # ----------------------------------------------------------------- batched calls

    def next_token_logprobs(self, requests: Sequence[TokenScoreRequest]) -> list[TokenScores]:
        """Log-probabilities of each request's candidates as the token after its prompt."""
        jobs = token_score_jobs(self._vocab, requests, self.n_layers)
        with self._lock:
            self._require_open()
            return next_token_scores(self._groups, jobs, requests)

    def continuation_logprobs(
        self, requests: Sequence[ContinuationRequest]
    ) -> list[ContinuationScores]:
        """Log-probability of every continuation token given the prompt and the tokens before it."""
        jobs, active = continuation_jobs(self._vocab, requests)
        with self._lock:
            self._require_open()
            return continuation_scores(self._groups, jobs, active, requests)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Generation (greedy, or sampled as a request says) for all requests at once: one
        `llama_decode` per step for all."""
        jobs, active = generation_jobs(self._vocab, requests)
        with self._lock:
            self._require_open()
            return generations(self._groups, jobs, active, requests)

    # ----------------------------------------------------------------- validation

    def _require_open(self) -> None:
        if self._ctx is None or self._model is None:
            raise EngineError("the engine is closed")
        if os.getpid() != self._pid:
            # A forked child shares the parent's llama.cpp threads and buffers only in part.
            raise EngineError("a LlamaEngine cannot be used after fork; load it in this process")
