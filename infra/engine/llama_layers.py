"""Read the output of any transformer layer during `llama_decode` (llama.cpp's eval callback).

llama.cpp's embeddings API returns only the last layer's output, after the final norm. Its
graph names every block's output `l_out-<il>` (blocks counted from 0), and a context created
with an eval callback (`cb_eval`) is asked, node by node, whether the caller wants a tensor;
for a wanted one the scheduler computes the graph up to that node, hands it over, then goes
on. `LayerTap` is such a callback: armed with a set of layers for one decode, it copies those
tensors (one row per token of the micro-batch, in batch order) and ignores every other node.

Middle layers hold a row for every token of the batch; llama.cpp keeps only the output rows
in the last block, so read that one through the embeddings API instead.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import llama_cpp
import numpy as np
import numpy.typing as npt

from selfrag.infra.engine.cpu_builds.cpu_variants import library_dir

GGML_TYPE_F32 = 0


def _ggml_base() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_dir() / "libggml-base.so"))
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_nelements.argtypes = [ctypes.c_void_p]
    lib.ggml_nelements.restype = ctypes.c_int64
    lib.ggml_nrows.argtypes = [ctypes.c_void_p]
    lib.ggml_nrows.restype = ctypes.c_int64
    lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    lib.ggml_is_contiguous.restype = ctypes.c_bool
    lib.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
    ]
    lib.ggml_backend_tensor_get.restype = None
    return lib


class LayerTap:
    """An eval callback that copies the outputs of chosen layers during the decodes it is armed
    for. Give `callback` to the context's `cb_eval` and keep the tap alive as long as it."""

    def __init__(self) -> None:
        self._lib = _ggml_base()
        self._wanted: dict[bytes, int] = {}
        self._chunks: dict[int, list[npt.NDArray[np.float32]]] = {}
        self.error: str | None = None
        # ctypes keeps the C function pointer valid only while this object lives.
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_tensor)

    def arm(self, layers: Iterable[int]) -> None:
        """Capture these layers (0-based blocks) during the following decodes."""
        self._wanted = {f"l_out-{layer}".encode(): layer for layer in layers}
        self._chunks = {layer: [] for layer in self._wanted.values()}
        self.error = None

    def disarm(self) -> dict[int, npt.NDArray[np.float32]]:
        """Stop capturing; the rows each armed layer received since `arm`, one per decoded token
        in micro-batch order. A layer the graph never computed is absent; `error` says what
        went wrong if a copy failed."""
        chunks = self._chunks
        self._wanted, self._chunks = {}, {}
        return {
            layer: np.concatenate(parts) if len(parts) > 1 else parts[0]
            for layer, parts in chunks.items()
            if parts
        }

    def _on_tensor(self, tensor: int, ask: bool, _user_data: int) -> bool:
        if not self._wanted:
            return False
        layer = self._wanted.get(self._lib.ggml_get_name(tensor) or b"")
        if layer is None:
            return False
        if ask:
            return True
        try:
            self._chunks[layer].append(self._copy(tensor))
        except Exception as exc:  # an exception must not unwind through C
            self.error = f"could not read layer {layer}: {exc}"
        return True

    def _copy(self, tensor: int) -> npt.NDArray[np.float32]:
        if ctypes.c_int32.from_address(tensor).value != GGML_TYPE_F32:
            raise ValueError("the layer output is not float32")
        if not self._lib.ggml_is_contiguous(tensor):
            raise ValueError("the layer output is not contiguous")
        n = int(self._lib.ggml_nelements(tensor))
        rows = int(self._lib.ggml_nrows(tensor))
        out = np.empty((rows, n // rows), dtype=np.float32)
        self._lib.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
        return out
