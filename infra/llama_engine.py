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
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt

from selfrag.infra.kv_cache import ContextLayout, PrefixKey, PrefixStateStore, prefix_state_key
from selfrag.infra.kv_slots import KVJob, Slot, SlotPlanner
from selfrag.infra.lifecycle import Closeable
from selfrag.infra.llama_backend import ensure_backend
from selfrag.infra.llama_layers import LayerTap
from selfrag.infra.model_files import check_gguf, file_sha256
from selfrag.pipeline.protocols import (
    ContinuationRequest,
    ContinuationScores,
    FinishReason,
    Generation,
    GenerationRequest,
    TokenScoreRequest,
    TokenScores,
)
from selfrag.pipeline.segmenting import ends_sentence

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """llama.cpp failed to load the model or to decode a batch."""


@dataclass
class EngineStats:
    """Work counters since the engine was created (or `reset_stats`)."""

    prefill_tokens: int = 0
    """Prompt tokens decoded (the shared prefix of a batch counts once)."""
    cached_tokens: int = 0
    """Prompt tokens found in a slot's KV cache from an earlier call and not decoded again."""
    shared_tokens: int = 0
    """Prompt tokens a sequence received by copying the batch's shared prefix (seq_cp)."""
    generated_tokens: int = 0
    """Tokens produced by `generate` (stop and end-of-generation tokens included)."""
    decode_calls: int = 0
    """`llama_decode` calls, prefill chunks and generation steps together."""
    decode_steps: int = 0
    """Generation steps: `llama_decode` calls that advance every live sequence by one token."""
    batch_sizes: Counter[int] = field(default_factory=Counter)
    """How many `llama_decode` calls carried each number of distinct sequences."""
    kv_restores: int = 0
    """Reusable prefixes restored from the prefix-state store instead of decoded."""
    kv_restored_tokens: int = 0
    """Prompt tokens those restores supplied."""
    kv_saves: int = 0
    """Reusable prefix states computed here and put into the store."""
    kv_misses: int = 0
    """Store lookups that found no state (the prefix was decoded, then saved)."""
    kv_restore_failures: int = 0
    """Stored states llama.cpp rejected (corrupt, foreign); the prefix was recomputed."""

    def copy(self) -> EngineStats:
        return EngineStats(
            kv_restores=self.kv_restores,
            kv_restored_tokens=self.kv_restored_tokens,
            kv_saves=self.kv_saves,
            kv_misses=self.kv_misses,
            kv_restore_failures=self.kv_restore_failures,
            prefill_tokens=self.prefill_tokens,
            cached_tokens=self.cached_tokens,
            shared_tokens=self.shared_tokens,
            generated_tokens=self.generated_tokens,
            decode_calls=self.decode_calls,
            decode_steps=self.decode_steps,
            batch_sizes=Counter(self.batch_sizes),
        )


@dataclass
class _Feed:
    """Tokens to append to a slot in one decode pass; outputs requested from `out_from` on."""

    slot: Slot
    tokens: list[int]
    out_from: int
    on_logits: Callable[[int, int], None] | None
    """Called with (absolute position, batch index) once that position's logits exist."""
    hidden: bool = False
    """The outputs also need the final hidden state (`_hidden_view`)."""
    layers: tuple[int, ...] = ()
    """The outputs also need these blocks' outputs (`_layer_rows`)."""


class _LlamaMemory:
    """`KVMemory` on a llama.cpp context's memory."""

    def __init__(self, memory: llama_cpp.llama_memory_t) -> None:
        self._mem = memory

    def seq_cp(self, src: int, dest: int, length: int) -> None:
        llama_cpp.llama_memory_seq_cp(self._mem, src, dest, 0, length)

    def seq_rm(self, seq: int, n_keep: int) -> None:
        if not llama_cpp.llama_memory_seq_rm(self._mem, seq, n_keep, -1):
            raise EngineError(f"llama.cpp could not trim sequence {seq} to {n_keep}")

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, False)


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
    ) -> None:
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max must be at least 1, got {n_seq_max}")
        if n_batch < 1 or n_ctx < 1:
            raise ValueError(f"n_ctx and n_batch must be positive, got {n_ctx} and {n_batch}")
        if n_threads < 0:
            raise ValueError(f"n_threads must be 0 (all cores) or positive, got {n_threads}")
        check_gguf(model_path)
        threads = n_threads or os.cpu_count() or 1
        # Probes the model in a child process first: an unusable CPU feature must not kill us.
        ensure_backend(model_path, n_threads=threads)
        self._model_id = model_id
        self.model_path = model_path
        self.prefix_store = prefix_store
        self.prefix_min_tokens = max(prefix_min_tokens, 1)
        self._model_sha256 = model_sha256
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._ctx: llama_cpp.llama_context_p | None = None
        self._model: llama_cpp.llama_model_p | None = None
        self._batch: llama_cpp.llama_batch | None = None

        model_params = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), model_params)
        if not self._model:
            self._model = None
            raise EngineError(f"llama.cpp could not load the model file {model_path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._n_embd = int(llama_cpp.llama_model_n_embd(self._model))

        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = n_batch
        ctx_params.n_ubatch = min(n_batch, 512)
        ctx_params.n_seq_max = n_seq_max
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        # One cache for all sequences: seq_cp only tags cells, and a long prompt may use more
        # than n_ctx / n_seq_max cells.
        ctx_params.kv_unified = True
        ctx_params.no_perf = True
        # Hidden states are switched on only for the decode calls that read them: with
        # embeddings on, llama.cpp computes logits for every token of the batch.
        ctx_params.embeddings = False
        ctx_params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        self._n_layers = int(llama_cpp.llama_model_n_layer(self._model))
        # The eval callback is asked about every graph node of every decode, so it is only
        # installed for an engine whose critique reads a middle layer.
        self._tap = LayerTap() if layer_tap else None
        self._layer_rows: dict[int, npt.NDArray[np.float32]] = {}
        if self._tap is not None:
            ctx_params.cb_eval = self._tap.callback
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            self._ctx = None
            self.close()
            raise EngineError(
                f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max}, "
                f"n_batch={n_batch}) for {model_path}"
            )
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._embeddings_on = False
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self.n_seq_max = n_seq_max
        self.n_threads = threads
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._batch_tokens = np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,))
        self._batch_pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._batch_n_seq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self.n_batch,))
        self._batch_logits = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        self._batch_n_seq[:] = 1
        self._planner = SlotPlanner(
            _LlamaMemory(self._mem),
            n_ctx=self.n_ctx,
            n_seq_max=n_seq_max,
            prefix_cache=prefix_cache,
            share_prefix=share_prefix,
        )
        self._stats = EngineStats()
        self._chat_template = self._meta_str("tokenizer.chat_template")
        self.layout = ContextLayout(
            n_ctx=self.n_ctx,
            n_seq_max=n_seq_max,
            kv_unified=bool(ctx_params.kv_unified),
            type_k=int(ctx_params.type_k),
            type_v=int(ctx_params.type_v),
            llama_cpp_version=llama_cpp.__version__,
        )
        """What a saved sequence state of this context needs in order to restore elsewhere."""
        if prefix_store is not None and model_sha256 is None:
            self._model_sha256 = file_sha256(model_path)

    @property
    def slots(self) -> Sequence[Slot]:
        """What each KV sequence holds now (for inspection; the planner owns them)."""
        return self._planner.slots

    @property
    def prefix_cache(self) -> bool:
        """Whether slots keep their content across calls (off: every call starts empty)."""
        return self._planner.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, on: bool) -> None:
        self._planner.prefix_cache = on

    @property
    def share_prefix(self) -> bool:
        """Whether a call's common prefix is decoded once and shared (`seq_cp`)."""
        return self._planner.share_prefix

    @share_prefix.setter
    def share_prefix(self, on: bool) -> None:
        self._planner.share_prefix = on

    # ----------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Free the batch, the context and the model once the call in progress (if any) has
        ended; later calls raise. Safe to call twice."""
        if getattr(self, "_pid", os.getpid()) != os.getpid():
            # In a forked child the native objects belong to the parent: just let go of them.
            self._batch = self._ctx = self._model = None
            return
        lock = getattr(self, "_lock", None)  # absent when __init__ failed early
        if lock is None:
            self._free()
            return
        with lock:  # freeing under a running decode would crash the process
            self._free()

    def _free(self) -> None:
        if getattr(self, "_batch", None) is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
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
        return self._model_sha256

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

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
            return self._stats.copy()

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = EngineStats()

    def clear_cache(self) -> None:
        """Forget every cached sequence (the next call starts from an empty KV cache)."""
        with self._lock:
            self._require_open()
            self._planner.clear()

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
        data = text.encode("utf-8")
        if not data:
            return []
        size = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * size)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, size, False, special)
            if n >= 0:
                return list(buf[:n])
            if -n <= size:
                raise EngineError(f"llama.cpp could not tokenize a text of {len(data)} bytes")
            size = -n

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of `tokens`, special tokens written out as their text."""
        self._require_open()
        if not tokens:
            return ""
        self._check_tokens(tokens, "tokens")
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        size = 8 * len(tokens) + 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(self._vocab, arr, len(tokens), buf, size, False, True)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = -n + 1

    def special_token_id(self, piece: str) -> int | None:
        """The id of `piece` when the vocabulary holds it as one control/user-defined token."""
        tokens = self.tokenize(piece, special=True)
        if len(tokens) != 1:
            return None
        attr = int(llama_cpp.llama_vocab_get_attr(self._vocab, tokens[0]))
        special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        return tokens[0] if attr & special else None

    def bos_tokens(self) -> list[int]:
        """[BOS] when the model's vocabulary asks for it at the start of a prompt, else []."""
        self._require_open()
        bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        if bos >= 0 and llama_cpp.llama_vocab_get_add_bos(self._vocab):
            return [bos]
        return []

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, end-of-turn, ...)."""
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    # ----------------------------------------------------------------- batched calls

    def next_token_logprobs(self, requests: Sequence[TokenScoreRequest]) -> list[TokenScores]:
        """Log-probabilities of each request's candidates as the token after its prompt."""
        jobs: list[KVJob] = []
        for i, req in enumerate(requests):
            prompt = self._prompt(req.prompt, f"requests[{i}].prompt")
            self._check_tokens(req.candidates, f"requests[{i}].candidates")
            self._check_layers(req.hidden_layers, f"requests[{i}].hidden_layers")
            n = len(prompt)
            jobs.append(
                KVJob(
                    tokens=prompt,
                    reuse_limit=n - 1,
                    out_from=n - 1,
                    reusable=min(req.reusable_prefix, n - 1),
                    hidden=req.hidden_state,
                    last_alone=req.hidden_state,
                    layers=tuple(req.hidden_layers),
                )
            )
        results: list[list[float]] = [[] for _ in requests]
        hidden: list[tuple[float, ...] | None] = [None] * len(requests)
        layer_states: list[dict[int, tuple[float, ...]]] = [{} for _ in requests]

        def on_logits(job: int, pos: int, batch_index: int) -> None:
            logprobs = self._log_softmax(batch_index)
            results[job] = [float(logprobs[c]) for c in requests[job].candidates]
            if jobs[job].hidden:
                hidden[job] = tuple(self._hidden_view(batch_index).tolist())
            for layer in jobs[job].layers:
                layer_states[job][layer] = tuple(self._layer_rows[layer][batch_index].tolist())

        with self._lock:
            self._require_open()
            self._check_fits(jobs)
            for group in self._planner.groups(list(range(len(jobs))), jobs):
                self._prefill(jobs, group, on_logits)
        return [
            TokenScores(
                logprobs=results[i],
                prefill_tokens=jobs[i].prefill,
                hidden_state=hidden[i],
                layer_states=layer_states[i],
            )
            for i in range(len(jobs))
        ]

    def continuation_logprobs(
        self, requests: Sequence[ContinuationRequest]
    ) -> list[ContinuationScores]:
        """Log-probability of every continuation token given the prompt and the tokens before it."""
        jobs: list[KVJob] = []
        active: list[int] = []
        for i, req in enumerate(requests):
            prompt = self._prompt(req.prompt, f"requests[{i}].prompt")
            continuation = self._check_tokens(req.continuation, f"requests[{i}].continuation")
            n = len(prompt)
            # The last continuation token is only a target: it needs no KV entry of its own.
            jobs.append(
                KVJob(
                    tokens=prompt + continuation[:-1],
                    reuse_limit=n - 1,
                    out_from=n - 1,
                    reusable=min(req.reusable_prefix, n - 1),
                )
            )
            if continuation:
                active.append(i)
        results: list[list[float]] = [[0.0] * len(r.continuation) for r in requests]

        def on_logits(job: int, pos: int, batch_index: int) -> None:
            logprobs = self._log_softmax(batch_index)
            offset = pos - jobs[job].out_from
            target = requests[job].continuation[offset]
            results[job][offset] = float(logprobs[target])

        with self._lock:
            self._require_open()
            self._check_fits([jobs[i] for i in active])
            for group in self._planner.groups(active, jobs):
                self._prefill(jobs, group, on_logits)
        return [
            ContinuationScores(logprobs=results[i], prefill_tokens=jobs[i].prefill)
            for i in range(len(jobs))
        ]

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Greedy generation for all requests at once: one `llama_decode` per step for all."""
        jobs: list[KVJob] = []
        active: list[int] = []
        for i, req in enumerate(requests):
            prompt = self._prompt(req.prompt, f"requests[{i}].prompt")
            if req.max_tokens < 0:
                raise ValueError(f"requests[{i}].max_tokens must not be negative")
            self._check_tokens(sorted(req.stop_token_ids), f"requests[{i}].stop_token_ids")
            n = len(prompt)
            # A job holds at most max_tokens - 1 generated tokens in the KV cache: the last
            # chosen token is never decoded.
            reserve = max(req.max_tokens - 1, 0)
            jobs.append(
                KVJob(
                    tokens=prompt,
                    reuse_limit=n - 1,
                    out_from=n - 1,
                    reserve=reserve,
                    reusable=min(req.reusable_prefix, n - 1),
                )
            )
            if req.max_tokens > 0:
                active.append(i)
        outputs: list[Generation | None] = [None] * len(requests)
        for i, req in enumerate(requests):
            if req.max_tokens == 0:
                outputs[i] = Generation(
                    tokens=[], text="", logprobs=[], finish_reason="length", prefill_tokens=0
                )
        with self._lock:
            self._require_open()
            self._check_fits([jobs[i] for i in active])
            for group in self._planner.groups(active, jobs):
                for i, gen in zip(group, self._generate_group(jobs, group, requests), strict=True):
                    outputs[i] = gen
        return [g for g in outputs if g is not None]

    # ----------------------------------------------------------------- generation

    def _generate_group(
        self, jobs: list[KVJob], group: list[int], requests: Sequence[GenerationRequest]
    ) -> list[Generation]:
        tokens: dict[int, list[int]] = {i: [] for i in group}
        logprobs: dict[int, list[float]] = {i: [] for i in group}
        finish: dict[int, tuple[FinishReason, int | None]] = {}
        pending: dict[int, tuple[int, float]] = {}

        def choose(job: int, pos: int, batch_index: int) -> None:
            logits = self._logits_view(batch_index)
            token = int(np.argmax(logits))
            pending[job] = (token, self._greedy_logprob(logits, token))

        self._prefill(jobs, group, choose)
        while True:
            live: list[int] = []
            for i in group:
                if i in finish:
                    continue
                token, logprob = pending.pop(i)
                req = requests[i]
                self._stats.generated_tokens += 1
                if token in req.stop_token_ids:
                    finish[i] = ("stop_token", token)
                    continue
                if self.is_eog(token):
                    finish[i] = ("eos", None)
                    continue
                tokens[i].append(token)
                logprobs[i].append(logprob)
                if req.stop_at_sentence_end and ends_sentence(self.detokenize(tokens[i])):
                    finish[i] = ("sentence", None)
                elif len(tokens[i]) >= req.max_tokens:
                    finish[i] = ("length", None)
                else:
                    live.append(i)
            if not live:
                break
            feeds = [
                _Feed(
                    slot=self._slot_of(jobs[i]),
                    tokens=[tokens[i][-1]],
                    out_from=len(self._slot_of(jobs[i]).tokens),
                    on_logits=(lambda pos, bi, job=i: choose(job, pos, bi)),
                )
                for i in live
            ]
            self._stats.decode_steps += 1
            self._decode(feeds)
        return [
            Generation(
                tokens=tokens[i],
                text=self.detokenize(tokens[i]),
                logprobs=logprobs[i],
                finish_reason=finish[i][0],
                prefill_tokens=jobs[i].prefill,
                stop_token=finish[i][1],
            )
            for i in group
        ]

    # ----------------------------------------------------------------- planning

    def _check_fits(self, jobs: Sequence[KVJob]) -> None:
        for job in jobs:
            need = len(job.tokens) + job.reserve
            if need > self.n_ctx:
                extra = f" plus {job.reserve} tokens to generate" if job.reserve else ""
                raise ValueError(
                    f"a prompt of {len(job.tokens)} tokens{extra} needs {need} KV cells, "
                    f"more than the context holds (n_ctx={self.n_ctx})"
                )

    def _prefill(
        self, jobs: list[KVJob], group: list[int], on_logits: Callable[[int, int, int], None]
    ) -> None:
        """Bring every job of `group` into a slot, decode what is missing, report its logits."""
        self._planner.tick()
        if not self.prefix_cache:
            self._planner.clear()
        group_jobs = [jobs[i] for i in group]
        if self.prefix_store is not None and self.prefix_cache:
            self._stage_prefixes(group_jobs)
        shared = self._planner.shared_prefix(group_jobs)
        plan = self._planner.place(group_jobs, shared)
        if plan is None:
            # Cached prefixes held in cells of their own can leave too little room; an empty
            # cache always fits, as `_groups` sized the group for it.
            self._planner.clear()
            plan = self._planner.place(group_jobs, shared)
            if plan is None:
                raise EngineError(
                    f"{len(group_jobs)} sequences do not fit the KV cache (n_ctx={self.n_ctx})"
                )
        # Staged tokens were counted as restored or prefilled already.
        self._stats.cached_tokens += sum(
            c - min(c, j.staged) for c, j in zip(plan.cached, group_jobs, strict=True)
        )

        if plan.root >= 0:
            root_job = group_jobs[plan.root]
            root_slot = self._slot_of(root_job)
            if plan.cached[plan.root] < shared:
                missing = root_job.tokens[plan.cached[plan.root] : shared]
                root_job.prefill += len(missing)
                self._stats.prefill_tokens += len(missing)
                self._decode([_Feed(root_slot, missing, shared, None)])
            for k in plan.copies:
                self._planner.copy_prefix(root_slot, self._slot_of(group_jobs[k]), shared)
                self._stats.shared_tokens += shared

        feeds: list[_Feed] = []
        tails: list[_Feed] = []
        for k, (i, job) in enumerate(zip(group, group_jobs, strict=True)):
            suffix = job.tokens[plan.starts[k] :]
            job.prefill += len(suffix)
            self._stats.prefill_tokens += len(suffix)
            feed = _Feed(
                slot=self._slot_of(job),
                tokens=suffix,
                out_from=job.out_from,
                on_logits=(lambda pos, bi, job_index=i: on_logits(job_index, pos, bi)),
                hidden=job.hidden,
                layers=job.layers,
            )
            if job.last_alone and len(suffix) > 1:
                # With hidden states on, llama.cpp outputs every token of a decode call: only
                # the last token, whose output is read, goes into that call.
                feeds.append(_Feed(feed.slot, suffix[:-1], job.out_from, None))
                feed.tokens = suffix[-1:]
                tails.append(feed)
            else:
                feeds.append(feed)
        self._decode(feeds)
        if tails:
            self._decode(tails)

    # ----------------------------------------------------------------- prefix-state store

    def _stage_prefixes(self, group_jobs: list[KVJob]) -> None:
        """Put each job's reusable prefix alone into a slot, restored from the store if it can.

        Only the exact prefix computed from position 0 is ever restored or saved (a sequence's
        state holds all its tokens, so a prefix is saved while its slot holds nothing else). A
        prefix some slot already holds is left to the planner. The planner then finds each
        staged slot as a cached source and decodes only the rest of the prompt.
        """
        assert self.prefix_store is not None and self._model_sha256 is not None
        staged: set[int] = set()
        misses: list[tuple[Slot, PrefixKey]] = []
        feeds: list[_Feed] = []
        for job in group_jobs:
            n = job.reusable
            if n < self.prefix_min_tokens:
                continue
            prefix = job.tokens[:n]
            holder = self._planner.holder_of(prefix)
            if holder is None:
                # Staged for decoding below: its tokens are not in the slot yet.
                holder = next((f.slot for f in feeds if f.tokens == prefix), None)
            if holder is not None:
                if holder.seq_id in staged:  # staged for an earlier job of this group
                    job.staged = n
                continue
            dest = self._planner.staging_slot(staged)
            if dest is None:
                break
            self._planner.trim(dest, 0)
            pending = sum(len(f.tokens) for f in feeds)
            if not self._planner.make_room(staged | {dest.seq_id}, pending + n):
                break
            dest.last_used = self._planner.clock
            staged.add(dest.seq_id)
            job.staged = n
            key = prefix_state_key(self._model_sha256, self.layout, prefix)
            state = self.prefix_store.get(key)
            if state is not None and self._restore(dest, prefix, state):
                self._stats.kv_restores += 1
                self._stats.kv_restored_tokens += n
                continue
            if state is None:
                self._stats.kv_misses += 1
            job.prefill += n
            self._stats.prefill_tokens += n
            misses.append((dest, key))
            feeds.append(_Feed(dest, prefix, n, None))
        if feeds:
            # All missing prefixes in one batch, each alone in its sequence, so that each
            # sequence's state is exactly its prefix when saved.
            self._decode(feeds)
            for slot, key in misses:
                self._save(slot, key)

    def _restore(self, dest: Slot, prefix: list[int], state: bytes) -> bool:
        """Load `state` into the empty slot `dest`; False (slot left empty) if llama.cpp refuses
        it or it does not hold exactly positions 0..len(prefix)-1."""
        # A disk state is a private writable mapping: restore from it in place, uncopied.
        kind = ctypes.c_uint8 * len(state)
        writable = isinstance(state, memoryview) and not state.readonly
        buf = kind.from_buffer(state) if writable else kind.from_buffer_copy(state)
        read = llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(state), dest.seq_id)
        lo = llama_cpp.llama_memory_seq_pos_min(self._mem, dest.seq_id)
        hi = llama_cpp.llama_memory_seq_pos_max(self._mem, dest.seq_id)
        if read == len(state) and lo == 0 and hi == len(prefix) - 1:
            dest.tokens = list(prefix)
            dest.cells = self._planner.fresh_cells(len(prefix))
            return True
        llama_cpp.llama_memory_seq_rm(self._mem, dest.seq_id, 0, -1)
        self._stats.kv_restore_failures += 1
        logger.warning(
            "a stored KV state of %d tokens (%d bytes) did not restore (read %d bytes, "
            "positions %d..%d); recomputing it",
            len(prefix),
            len(state),
            read,
            lo,
            hi,
        )
        return False

    def _save(self, slot: Slot, key: PrefixKey) -> None:
        """Put the state of `slot` (exactly the reusable prefix) into the store."""
        assert self.prefix_store is not None
        size = llama_cpp.llama_state_seq_get_size(self._ctx, slot.seq_id)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, slot.seq_id)
        if written <= 0:
            logger.warning("llama.cpp could not save the state of sequence %d", slot.seq_id)
            return
        self.prefix_store.put(key, bytes(memoryview(buf)[:written]))
        self._stats.kv_saves += 1

    # ----------------------------------------------------------------- KV cache and decoding

    def _decode(self, feeds: list[_Feed]) -> None:
        """Append the feeds' tokens to their slots, n_batch tokens per `llama_decode`."""
        items: list[tuple[_Feed, int, int]] = []  # (feed, token, absolute position)
        for feed in feeds:
            start = len(feed.slot.tokens)
            items.extend((feed, tok, start + j) for j, tok in enumerate(feed.tokens))
        for begin in range(0, len(items), self.n_batch):
            chunk = items[begin : begin + self.n_batch]
            outputs: list[tuple[_Feed, int, int]] = []
            seqs: set[int] = set()
            for b, (feed, tok, pos) in enumerate(chunk):
                self._batch_tokens[b] = tok
                self._batch_pos[b] = pos
                self._batch.seq_id[b][0] = feed.slot.seq_id
                wants = feed.on_logits is not None and pos >= feed.out_from
                self._batch_logits[b] = 1 if wants else 0
                if wants:
                    outputs.append((feed, pos, b))
                seqs.add(feed.slot.seq_id)
            self._batch.n_tokens = len(chunk)
            self._set_embeddings(any(feed.hidden for feed, _, _ in outputs))
            layers = {layer for feed, _, _ in outputs for layer in feed.layers}
            tap = self._tap if layers else None
            self._layer_rows = {}
            if tap is not None:
                tap.arm(layers)
            try:
                status = llama_cpp.llama_decode(self._ctx, self._batch)
            finally:
                captured = tap.disarm() if tap is not None else {}
            self._stats.decode_calls += 1
            self._stats.batch_sizes[len(seqs)] += 1
            if status != 0:
                # The KV cache may now hold part of the batch: forget everything.
                self._planner.clear()
                raise EngineError(
                    f"llama_decode failed with status {status} on a batch of {len(chunk)} tokens "
                    f"in {len(seqs)} sequences"
                )
            for feed, tok, _pos in chunk:
                feed.slot.tokens.append(tok)
                feed.slot.cells.extend(self._planner.fresh_cells(1))
            if tap is not None:
                self._layer_rows = self._checked_rows(tap, layers, captured, len(chunk))
            for feed, pos, b in outputs:
                assert feed.on_logits is not None
                feed.on_logits(pos, b)

    @staticmethod
    def _checked_rows(
        tap: LayerTap,
        layers: set[int],
        rows: dict[int, npt.NDArray[np.float32]],
        n_tokens: int,
    ) -> dict[int, npt.NDArray[np.float32]]:
        """The captured rows of one decode call, indexed like its batch. A middle block keeps
        a row for every token of the call (only the last block drops all but the outputs), and
        with one KV stream (kv_unified) llama.cpp splits a batch into micro-batches in order."""
        if tap.error is not None:
            raise EngineError(f"reading a middle layer failed: {tap.error}")
        for layer in sorted(layers):
            if layer not in rows:
                raise EngineError(f"llama.cpp's graph computed no tensor l_out-{layer}")
            if rows[layer].shape[0] != n_tokens:
                raise EngineError(
                    f"llama.cpp's block {layer} held {rows[layer].shape[0]} rows for a batch "
                    f"of {n_tokens} tokens"
                )
        return rows

    def _set_embeddings(self, on: bool) -> None:
        if on != self._embeddings_on:
            llama_cpp.llama_set_embeddings(self._ctx, on)
            self._embeddings_on = on

    def _hidden_view(self, batch_index: int) -> npt.NDArray[np.float32]:
        """The final hidden state of one output of the last decode (a view, no copy)."""
        ptr = llama_cpp.llama_get_embeddings_ith(self._ctx, batch_index)
        if not ptr:
            raise EngineError(f"llama.cpp has no hidden state for batch position {batch_index}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_embd,))

    def _logits_view(self, batch_index: int) -> npt.NDArray[np.float32]:
        """The logits of one output of the last decode, as a view (no copy)."""
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        if not ptr:
            raise EngineError(f"llama.cpp has no logits for batch position {batch_index}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def _log_softmax(self, batch_index: int) -> npt.NDArray[np.float64]:
        logits = self._logits_view(batch_index).astype(np.float64)
        top = logits.max()
        logits -= top + np.log(np.exp(logits - top).sum())
        return logits

    @staticmethod
    def _greedy_logprob(logits: npt.NDArray[np.float32], token: int) -> float:
        """Log-probability of the argmax `token`, computed once per sequence and step.

        exp runs in float32 (terms in [0, 1], relative error ~1e-7) and the sum in float64;
        this keeps the per-step cost at a fraction of a millisecond for a 49k vocabulary.
        """
        shifted = logits - logits[token]
        return float(-np.log(np.exp(shifted).sum(dtype=np.float64)))

    # ----------------------------------------------------------------- validation

    def _slot_of(self, job: KVJob) -> Slot:
        assert job.slot is not None
        return job.slot

    def _require_open(self) -> None:
        if self._ctx is None or self._model is None:
            raise EngineError("the engine is closed")
        if os.getpid() != self._pid:
            # A forked child shares the parent's llama.cpp threads and buffers only in part.
            raise EngineError("a LlamaEngine cannot be used after fork; load it in this process")

    def _check_layers(self, layers: Sequence[int], what: str) -> None:
        if not layers:
            return
        if self._tap is None:
            raise ValueError(f"{what}: this engine was created without layer_tap")
        bad = [layer for layer in layers if not 0 <= layer < self._n_layers - 1]
        if bad:
            raise ValueError(
                f"{what}: blocks {bad} out of range; a middle block is 0..{self._n_layers - 2} "
                "(the last block's output is the hidden state)"
            )

    def _check_tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        try:
            out = [int(t) for t in tokens]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what}: token ids must be integers ({exc})") from exc
        for t in out:
            if not 0 <= t < self._n_vocab:
                raise ValueError(
                    f"{what}: token id {t} is outside the vocabulary (0..{self._n_vocab - 1})"
                )
        return out

    def _prompt(self, prompt: Sequence[int], what: str) -> list[int]:
        tokens = self._check_tokens(prompt, what)
        if not tokens:
            raise ValueError(f"{what} is empty: at least one token (e.g. BOS) is needed")
        return tokens
