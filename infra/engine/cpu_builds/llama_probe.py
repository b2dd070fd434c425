"""The probe child of `infra.engine.cpu_builds.llama_cpu_builds`: `score PATH` prints a CPU
backend library's ggml score; `probe MODEL [--variant LIB]` loads the model with that backend
and decodes a prompt batch and two single tokens, so a CPU feature that kills the process kills
this child only."""

from __future__ import annotations

import argparse
import ctypes
import sys
from collections.abc import Sequence
from pathlib import Path

from selfrag.infra.engine.cpu_builds.cpu_variants import library_dir
from selfrag.infra.engine.cpu_builds.llama_cpu_builds import PROBE_PROMPT, load_variant
from selfrag.infra.engine.cpu_builds.llama_init import route_llama_log


def _score(path: str) -> int:
    # The variant needs libggml-base by its soname; the one already loaded satisfies that.
    ctypes.CDLL(str(library_dir() / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(path)
    try:
        fn = lib.ggml_backend_score
    except AttributeError:
        print(0)
        return 0
    fn.restype = ctypes.c_int
    print(int(fn()))
    return 0


def _probe_main(model: str, variant: str | None, n_threads: int) -> int:
    import llama_cpp

    route_llama_log()  # keeps its callback alive: a collected one is a dangling pointer
    if variant is not None:
        load_variant(Path(variant))
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    handle = llama_cpp.llama_model_load_from_file(model.encode(), params)
    if not handle:
        print(f"llama.cpp could not load {model}", file=sys.stderr)
        return 3
    ctx_params = llama_cpp.llama_context_default_params()
    ctx_params.n_ctx = 256
    ctx_params.n_batch = 128
    ctx_params.n_threads = ctx_params.n_threads_batch = max(n_threads, 1)
    ctx = llama_cpp.llama_init_from_model(handle, ctx_params)
    if not ctx:
        print("llama.cpp could not create a context", file=sys.stderr)
        return 3
    vocab = llama_cpp.llama_model_get_vocab(handle)
    data = PROBE_PROMPT.encode()
    buf = (llama_cpp.llama_token * 256)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, 256, True, False)
    tokens = list(buf[: max(n, 0)]) or [0]
    # A prompt batch (the matmul kernels) and then single-token steps (the vector kernels).
    steps = [tokens, [tokens[-1]], [tokens[0]]]
    for step in steps:
        arr = (llama_cpp.llama_token * len(step))(*step)
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(step))) != 0:
            print("llama_decode failed", file=sys.stderr)
            return 4
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(handle)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfrag.infra.engine.cpu_builds.llama_probe")
    sub = parser.add_subparsers(dest="command", required=True)
    p_score = sub.add_parser("score", help="print a CPU backend library's ggml score")
    p_score.add_argument("path")
    p_probe = sub.add_parser("probe", help="load a model with one backend and decode")
    p_probe.add_argument("model")
    p_probe.add_argument("--variant")
    p_probe.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "score":
        return _score(args.path)
    return _probe_main(args.model, args.variant, args.threads)


if __name__ == "__main__":
    sys.exit(main())
