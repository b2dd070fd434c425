"""One llama.cpp batch (ctypes) on a context: append tokens to KV slots, read their outputs.

`BatchDecoder.decode` takes the feeds of several slots, fills llama.cpp's `llama_batch` arrays
in place (numpy views, no Python list per call) and runs `llama_decode` per `n_batch` tokens.
Only the positions a feed asks for produce outputs; the hidden state (embeddings) is switched
on only for calls that read it, and middle blocks are captured by the `LayerTap` only when
asked for. Outputs are read as views right after the call that made them (`on_logits`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp
import numpy as np
import numpy.typing as npt

from selfrag.infra.engine.engine_stats import EngineStats
from selfrag.infra.engine.kv_slots import Slot, SlotPlanner
from selfrag.infra.engine.llama_layers import LayerTap
from selfrag.infra.engine.llama_threads import ThreadChooser


class EngineError(RuntimeError):
    """llama.cpp failed to load the model or to decode a batch."""


@dataclass
class Feed:
    """Tokens to append to a slot in one decode pass; outputs requested from `out_from` on."""

    slot: Slot
    tokens: list[int]
    out_from: int
    on_logits: Callable[[int, int], None] | None
    """Called with (absolute position, batch index) once that position's logits exist."""
    hidden: bool = False
    """The outputs also need the final hidden state (`hidden_view`)."""
    layers: tuple[int, ...] = ()
    """The outputs also need these blocks' outputs (`layer_rows`)."""


class BatchDecoder:
    """The `llama_batch` of one context and the reads of its outputs."""

    def __init__(
        self,
        ctx: llama_cpp.llama_context_p,
        *,
        n_batch: int,
        n_vocab: int,
        n_embd: int,
        planner: SlotPlanner,
        stats: EngineStats,
        tap: LayerTap | None,
        threads: ThreadChooser,
    ) -> None:
        self._ctx = ctx
        self.n_batch = n_batch
        self._n_vocab = n_vocab
        self._n_embd = n_embd
        self._planner = planner
        self._stats = stats
        self._tap = tap
        self._embeddings_on = False
        self.threads = threads
        self.layer_rows: dict[int, npt.NDArray[np.float32]] = {}
        """The captured block outputs of the last decode call, indexed like its batch."""
        self._batch: llama_cpp.llama_batch | None = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(n_batch,))
        self._n_seq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n_batch,))
        self._logits = np.ctypeslib.as_array(self._batch.logits, shape=(n_batch,))
        self._n_seq[:] = 1

    def free(self) -> None:
        """Free the batch (safe twice); the context stays the caller's."""
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None

    def forget(self) -> None:
        """Let go of the native objects without freeing them (a forked child's copy)."""
        self._batch = None
        self._ctx = None

    def decode(self, feeds: list[Feed]) -> None:
        """Append the feeds' tokens to their slots, n_batch tokens per `llama_decode`."""
        assert self._batch is not None
        items: list[tuple[Feed, int, int]] = []  # (feed, token, absolute position)
        for feed in feeds:
            start = len(feed.slot.tokens)
            items.extend((feed, tok, start + j) for j, tok in enumerate(feed.tokens))
        for begin in range(0, len(items), self.n_batch):
            chunk = items[begin : begin + self.n_batch]
            outputs: list[tuple[Feed, int, int]] = []
            seqs: set[int] = set()
            for b, (feed, tok, pos) in enumerate(chunk):
                self._tokens[b] = tok
                self._pos[b] = pos
                self._batch.seq_id[b][0] = feed.slot.seq_id
                wants = feed.on_logits is not None and pos >= feed.out_from
                self._logits[b] = 1 if wants else 0
                if wants:
                    outputs.append((feed, pos, b))
                seqs.add(feed.slot.seq_id)
            self._batch.n_tokens = len(chunk)
            self._set_embeddings(any(feed.hidden for feed, _, _ in outputs))
            layers = {layer for feed, _, _ in outputs for layer in feed.layers}
            tap = self._tap if layers else None
            self.layer_rows = {}
            if tap is not None:
                tap.arm(layers)
            reads = self._embeddings_on or tap is not None
            n_threads = self._set_threads(len(chunk), reads)
            started = time.perf_counter()
            try:
                status = llama_cpp.llama_decode(self._ctx, self._batch)
            finally:
                captured = tap.disarm() if tap is not None else {}
            seconds = time.perf_counter() - started
            self.threads.record(len(chunk), n_threads, seconds, reads=reads)
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
                self.layer_rows = _checked_rows(tap, layers, captured, len(chunk))
            for feed, pos, b in outputs:
                assert feed.on_logits is not None
                feed.on_logits(pos, b)

    def _set_threads(self, n_tokens: int, reads: bool) -> int:
        n = self.threads.choose(n_tokens, reads=reads)
        if n != llama_cpp.llama_n_threads(self._ctx):
            llama_cpp.llama_set_n_threads(self._ctx, n, n)
        return n

    def _set_embeddings(self, on: bool) -> None:
        if on != self._embeddings_on:
            llama_cpp.llama_set_embeddings(self._ctx, on)
            self._embeddings_on = on

    def hidden_view(self, batch_index: int) -> npt.NDArray[np.float32]:
        """The final hidden state of one output of the last decode (a view, no copy)."""
        ptr = llama_cpp.llama_get_embeddings_ith(self._ctx, batch_index)
        if not ptr:
            raise EngineError(f"llama.cpp has no hidden state for batch position {batch_index}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_embd,))

    def logits_view(self, batch_index: int) -> npt.NDArray[np.float32]:
        """The logits of one output of the last decode, as a view (no copy)."""
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        if not ptr:
            raise EngineError(f"llama.cpp has no logits for batch position {batch_index}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def log_softmax(self, batch_index: int) -> npt.NDArray[np.float64]:
        logits = self.logits_view(batch_index).astype(np.float64)
        top = logits.max()
        logits -= top + np.log(np.exp(logits - top).sum())
        return logits


def greedy_logprob(logits: npt.NDArray[np.float32], token: int) -> float:
    """Log-probability of the argmax `token`, computed once per sequence and step.

    exp runs in float32 (terms in [0, 1], relative error ~1e-7) and the sum in float64;
    this keeps the per-step cost at a fraction of a millisecond for a 49k vocabulary.
    """
    shifted = logits - logits[token]
    return float(-np.log(np.exp(shifted).sum(dtype=np.float64)))


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
