"""A `LlamaEngine`'s llama.cpp context: the sizes it refuses, the parameters it is created
with, and the `KVMemory` handle the slot planner edits its KV cache through."""

from __future__ import annotations

import llama_cpp

from selfrag.infra.engine.llama_batch import EngineError


class LlamaMemory:
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


def check_sizes(*, n_ctx: int, n_seq_max: int, n_batch: int, n_threads: int) -> None:
    """Refuse sizes llama.cpp cannot run with, naming the setting."""
    if n_seq_max < 1:
        raise ValueError(f"n_seq_max must be at least 1, got {n_seq_max}")
    if n_batch < 1 or n_ctx < 1:
        raise ValueError(f"n_ctx and n_batch must be positive, got {n_ctx} and {n_batch}")
    if n_threads < 0:
        raise ValueError(f"n_threads must be 0 (all cores) or positive, got {n_threads}")


def context_params(
    *, n_ctx: int, n_batch: int, n_seq_max: int, threads: int
) -> llama_cpp.llama_context_params:
    """The engine's llama.cpp context: one unified KV cache for all sequences, no pooling,
    hidden states off until a decode call reads them."""
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
    return ctx_params
