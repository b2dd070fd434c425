"""What installing the layer tap (llama.cpp's eval callback, `infra/engine/llama_layers.py`) costs.

Two engines on the same derived weights, threads and prompts, one created with
`layer_tap=True`. With the callback installed, llama.cpp asks it about every graph node of
every decode (~30 nodes per block); unarmed it answers "no" at once, so a normal decode pays
only those calls. Measured side by side, the engines taking turns rep by rep:

  generate: one greedy generation of `--tokens` tokens after a ~110-token chat prompt, cache
            off (every rep prefills again), as tokens generated per wall second and per CPU
            second of the process;
  read:     one `next_token_logprobs` call on the same prompt, cache off, without and (tap
            engine only) with three middle blocks requested (`hidden_layers`).

    .venv/bin/python -m bench.layer_tap [--reps 7] [--tokens 64] [--threads 1]

The last line holds the medians as name=value pairs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from selfrag.infra.engine.llama_engine import LlamaEngine
from selfrag.infra.models.model_files import default_model_path, derive_weights
from selfrag.pipeline.protocols import GenerationRequest, TokenScoreRequest

PROMPT = (
    "<|im_start|>system\nAnswer the question using the passage.<|im_end|>\n<|im_start|>user\n"
    "Passage: The Normans were the people who in the 10th and 11th centuries gave their name to "
    "Normandy, a region in France. They were descended from Norse raiders and pirates from "
    "Denmark, Iceland and Norway who, under their leader Rollo, agreed to swear fealty to King "
    "Charles III of West Francia.\n\nQuestion: Who was the Norse leader? Explain who the "
    "Normans were and where they came from.<|im_end|>\n<|im_start|>assistant\n"
)
LAYERS = (8, 14, 20)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and process CPU seconds of one call (CPU time is what load from other processes
    on shared cores disturbs least)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as home:
        weights = derive_weights(default_model_path(), "auto", Path(home))
        engines = {
            tap: LlamaEngine(
                weights,
                n_ctx=2048,
                n_seq_max=2,
                n_threads=args.threads,
                n_batch=512,
                model_id="smollm2",
                prefix_cache=False,
                layer_tap=tap,
            )
            for tap in (False, True)
        }
        prompt = engines[False].tokenize(PROMPT, special=True)
        gen = GenerationRequest(prompt, args.tokens, stop_at_sentence_end=False)
        plain = TokenScoreRequest(prompt, [1])
        tapped = TokenScoreRequest(prompt, [1], hidden_layers=LAYERS)
        outputs = {tap: e.generate([gen])[0].tokens for tap, e in engines.items()}  # warm-up
        n_generated = len(outputs[False])
        gen_s: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        read_s: dict[str, list[tuple[float, float]]] = {"off": [], "on": [], "on_read": []}
        for _ in range(args.reps):
            for tap, engine in engines.items():
                name = "on" if tap else "off"
                gen_s[name].append(timed(lambda e=engine: e.generate([gen])))
                read_s[name].append(timed(lambda e=engine: e.next_token_logprobs([plain])))
            read_s["on_read"].append(timed(lambda: engines[True].next_token_logprobs([tapped])))
        for engine in engines.values():
            engine.close()

    def med(rows: list[tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] for r in rows)

    tps = {k: n_generated / med(v, 0) for k, v in gen_s.items()}
    tpc = {k: n_generated / med(v, 1) for k, v in gen_s.items()}
    read_ms = {k: 1e3 * med(v, 0) for k, v in read_s.items()}
    read_cpu = {k: 1e3 * med(v, 1) for k, v in read_s.items()}
    same = outputs[False] == outputs[True]
    print(
        f"prompt {len(prompt)} tokens, {n_generated} generated, {args.reps} reps, "
        f"{args.threads} thread(s); same output with and without the tap: {same}"
    )
    print(f"{'(medians)':34}{'tap off':>10}{'tap on':>10}{'on/off':>8}")
    rows = [
        ("generate, tokens/s (wall)", tps["off"], tps["on"]),
        ("generate, tokens/s (CPU)", tpc["off"], tpc["on"]),
        ("read, no layers, ms (wall)", read_ms["off"], read_ms["on"]),
        ("read, no layers, ms (CPU)", read_cpu["off"], read_cpu["on"]),
        ("read, 3 middle layers, ms (wall)", read_ms["off"], read_ms["on_read"]),
        ("read, 3 middle layers, ms (CPU)", read_cpu["off"], read_cpu["on_read"]),
    ]
    for label, off, on in rows:
        print(f"{label:34}{off:>10.1f}{on:>10.1f}{on / off:>8.3f}")
    print(
        f"tokens_per_s_off={tps['off']:.1f} tokens_per_s_on={tps['on']:.1f} "
        f"generate_ratio={tps['on'] / tps['off']:.3f} "
        f"cpu_tokens_per_s_off={tpc['off']:.1f} cpu_tokens_per_s_on={tpc['on']:.1f} "
        f"cpu_generate_ratio={tpc['on'] / tpc['off']:.3f} read_ms_off={read_ms['off']:.1f} "
        f"read_ms_on={read_ms['on']:.1f} read_layers_ms={read_ms['on_read']:.1f} "
        f"same_output={same}"
    )


if __name__ == "__main__":
    main()
