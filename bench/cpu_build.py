"""llama.cpp builds side by side: prefill and decode speed of F16 and Q4_1 weights.

Compares llama-cpp-python builds installed in different folders (for example pip's default
`-march=native` build against the portable `GGML_CPU_ALL_VARIANTS` build of
scripts/install.sh) on the same machine, in one run. Each measurement runs in a child process
whose `llama_cpp` comes from one build (`--build NAME=SITE_DIR`, or `NAME=installed` for the
virtualenv's own); builds alternate every repetition so that background load hits them alike.

Per build and weights file: prefill tokens/s (one `--prompt-tokens` prompt, cold cache) and
decode ms/token (greedy, batch 1, `--gen` tokens), median over `--reps`, through the same
`LlamaEngine` the product uses. The last line holds the figures as name=value pairs.

    .venv/bin/python -m bench.cpu_build --build native=/tmp/native-llama --build portable=installed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to "
    "Normandy, a region in France. They were descended from Norse raiders and pirates from "
    "Denmark, Iceland and Norway who, under their leader Rollo, agreed to swear fealty to King "
    "Charles III of West Francia. Through generations of assimilation and mixing with the native "
    "Frankish and Roman-Gaulish populations, their descendants would gradually merge with the "
    "Carolingian-based cultures of West Francia. "
)


def measure(weights: Path, threads: int, prompt_tokens: int, gen: int) -> dict[str, object]:
    """One child's work: load, prefill once cold, decode greedily."""
    from selfrag.infra.engine.cpu_builds.llama_cpu_builds import loaded_backend
    from selfrag.infra.engine.llama_engine import LlamaEngine
    from selfrag.pipeline.protocols import GenerationRequest

    engine = LlamaEngine(
        weights,
        n_ctx=max(2048, prompt_tokens + gen + 64),
        n_seq_max=1,
        n_threads=threads,
        n_batch=512,
        model_id=weights.name,
        prefix_cache=False,
    )
    tokens = engine.tokenize(TEXT * (prompt_tokens // 80 + 1))[:prompt_tokens]
    engine.generate([GenerationRequest(tokens[:32], max_tokens=2)])  # page the weights in
    engine.clear_cache()
    start = time.perf_counter()
    engine.generate([GenerationRequest(tokens, max_tokens=1, stop_at_sentence_end=False)])
    prefill_s = time.perf_counter() - start
    engine.clear_cache()
    engine.generate([GenerationRequest(tokens[:16], max_tokens=1, stop_at_sentence_end=False)])
    start = time.perf_counter()
    out = engine.generate(
        [GenerationRequest(tokens[:16], max_tokens=gen, stop_at_sentence_end=False)]
    )
    decode_s = time.perf_counter() - start
    n_gen = max(len(engine.tokenize(out[0].text)), 1)
    variant = loaded_backend()
    return {
        "prefill_tok_s": prompt_tokens / prefill_s,
        "decode_ms_tok": 1000 * decode_s / n_gen,
        "backend": variant.name if variant else "?",
    }


def run_child(site: str, weights: Path, args: argparse.Namespace, cache: Path) -> dict:
    env = dict(os.environ)
    paths = [str(REPO)] if site == "installed" else [site, str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # Each build keeps its own probe results (they are keyed by the library files anyway).
    env["XDG_CACHE_HOME"] = str(cache)
    cmd = [
        sys.executable,
        "-m",
        "bench.cpu_build",
        "--child",
        str(weights),
        "--threads",
        str(args.threads),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--gen",
        str(args.gen),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-400:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="append", default=[], metavar="NAME=SITE_DIR")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.threads, args.prompt_tokens, args.gen)))
        return

    from selfrag.infra.models.model_files import default_model_path, derive_weights

    builds = dict(b.split("=", 1) for b in args.build) or {"installed": "installed"}
    home = Path(tempfile.mkdtemp(prefix="selfrag-cpu-build-"))
    q4 = default_model_path()
    weights = {"f16": derive_weights(q4, "f16", home), "q4_1": q4}
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.reps):
        for fmt, path in weights.items():
            for name, site in builds.items():
                out = run_child(site, path, args, home / f"cache-{name}")
                results.setdefault((name, fmt), []).append(out)
    print(f"{args.threads} threads, {args.prompt_tokens}-token prompt, {args.gen} decoded tokens")
    print(f"{'build':<12}{'weights':<8}{'backend':<16}{'prefill tok/s':>15}{'decode ms/tok':>15}")
    figures: dict[str, str] = {}
    for (name, fmt), runs in results.items():
        good = [r for r in runs if "error" not in r]
        if not good:
            print(f"{name:<12}{fmt:<8}FAILED: {runs[0]['error']}")
            figures[f"{name}_{fmt}_prefill_tok_s"] = "failed"
            continue
        prefill = statistics.median(r["prefill_tok_s"] for r in good)
        decode = statistics.median(r["decode_ms_tok"] for r in good)
        print(f"{name:<12}{fmt:<8}{good[0]['backend']:<16}{prefill:>15.1f}{decode:>15.2f}")
        figures[f"{name}_{fmt}_prefill_tok_s"] = f"{prefill:.1f}"
        figures[f"{name}_{fmt}_decode_ms_tok"] = f"{decode:.2f}"
    names = list(builds)
    if len(names) == 2:
        a, b = names
        for fmt in weights:
            try:
                ratio = float(figures[f"{b}_{fmt}_prefill_tok_s"]) / float(
                    figures[f"{a}_{fmt}_prefill_tok_s"]
                )
                figures[f"{b}_over_{a}_{fmt}_prefill"] = f"{ratio:.2f}"
                ratio = float(figures[f"{a}_{fmt}_decode_ms_tok"]) / float(
                    figures[f"{b}_{fmt}_decode_ms_tok"]
                )
                figures[f"{b}_over_{a}_{fmt}_decode"] = f"{ratio:.2f}"
            except (KeyError, ValueError):
                pass
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
