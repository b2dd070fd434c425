"""Branch batching benchmark: K evidence branches drafted one by one or as one batch.

Each branch prompt is a shared ~120-token prefix (instruction + question) followed by a
different Wikipedia passage (~250 tokens in all); each branch then generates 32 tokens greedily.
Ways to run one step of K branches, on the same weights file, threads and prompts:

  (a) one `llama_cpp.Llama.create_completion` per branch, in sequence, configured as the
      LlamaIndex Self-RAG pack configures it: `logits_all=True` on the model and `logprobs`
      on every call, because the pack reads its reflection-token probabilities from them;
  (a0) the same calls without logprobs and without `logits_all` — the strongest sequential
      baseline, not what the pack can run (the high-level class reuses the previous prompt's
      KV prefix itself, so it also decodes the shared prefix only once per step);
  (b) one `LlamaEngine.generate` call: all branches in one multi-sequence batch, every
      sequence prefilling its whole prompt (share_prefix=False, prefix_cache=False);
  (c) as (b), with the shared prefix decoded once and copied by seq_cp (share_prefix=True,
      prefix_cache=False, so every repetition starts cold).

Variants run interleaved (a, b, c, a, b, c, ...) so that load from other processes hits them
alike. Reported: median wall seconds per step, prompt tokens decoded, decode calls, and whether
the greedy outputs agree with (a). Run for the engine's default (derived) weights and for the
original Q4_1 file. The last line holds the figures as name=value pairs.

    .venv/bin/python -m bench.branches [--data ../shared/data] [--reps 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

from selfrag.infra.engine.llama_engine import LlamaEngine
from selfrag.infra.models.model_files import default_model_path, derive_weights
from selfrag.pipeline.protocols import GenerationRequest

SYSTEM = (
    "You are a careful assistant that answers questions using only the evidence passage given "
    "to you. Read the passage, decide whether it is relevant to the question, and write a short "
    "answer that is fully supported by the passage. If the passage does not contain the answer, "
    "say that the evidence is insufficient. Do not invent facts, dates or names that are not in "
    "the passage, and keep the answer to one or two sentences."
)
QUESTION = "Who was the first person to receive the Nobel Prize in Physics, and in which year?"


@dataclass
class StepResult:
    seconds: float
    prefill_tokens: int
    decode_calls: int
    outputs: list[list[int]]


def build_prompts(
    engine: LlamaEngine, passages: list[str], prompt_tokens: int
) -> tuple[list[list[int]], int]:
    """Chat prompts sharing instruction + question, each cut to `prompt_tokens` tokens."""
    head = engine.tokenize(
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
        f"Question: {QUESTION}\nPassage: ",
        special=True,
    )
    tail = engine.tokenize("<|im_end|>\n<|im_start|>assistant\n", special=True)
    room = prompt_tokens - len(head) - len(tail)
    if room < 16:
        raise SystemExit(f"--prompt-tokens {prompt_tokens} leaves no room after {len(head)}")
    prompts = [engine.bos_tokens() + head + engine.tokenize(p)[:room] + tail for p in passages]
    return prompts, len(engine.bos_tokens()) + len(head)


def run_sequential(
    llm: llama_cpp.Llama, prompts: list[list[int]], gen: int, logprobs: int | None = None
) -> StepResult:
    """(a)/(a0): one create_completion per branch; the Llama object starts each step cold."""
    llm.reset()
    prefill = 0
    outputs = []
    start = time.perf_counter()
    for prompt in prompts:
        cached = 0
        for a, b in zip(llm.input_ids[: llm.n_tokens].tolist(), prompt, strict=False):
            if a != b:
                break
            cached += 1
        prefill += len(prompt) - min(cached, len(prompt) - 1)
        out = llm.create_completion(
            prompt=prompt,
            max_tokens=gen,
            temperature=0.0,
            top_k=1,
            repeat_penalty=1.0,
            logprobs=logprobs,
        )
        outputs.append(llm.tokenize(out["choices"][0]["text"].encode(), add_bos=False))
    seconds = time.perf_counter() - start
    # create_completion returns text; its tokens are not exposed, so agreement with (b)/(c) is
    # judged on text, retokenized identically on both sides below.
    return StepResult(seconds, prefill, -1, outputs)


def run_batched(
    engine: LlamaEngine, prompts: list[list[int]], gen: int, *, share_prefix: bool
) -> StepResult:
    """(b)/(c): all branches in one `generate` call, cold cache."""
    engine.share_prefix = share_prefix
    engine.prefix_cache = False
    engine.clear_cache()
    before = engine.stats
    requests = [GenerationRequest(p, max_tokens=gen, stop_at_sentence_end=False) for p in prompts]
    start = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - start
    after = engine.stats
    outputs = [engine.tokenize(r.text) for r in results]
    return StepResult(
        seconds,
        after.prefill_tokens - before.prefill_tokens,
        after.decode_calls - before.decode_calls,
        outputs,
    )


def _llama(path: Path, args: argparse.Namespace, *, logits_all: bool) -> llama_cpp.Llama:
    # Same file, threads and batch size; flash attention on as in the engine's context (llama.cpp
    # enables it on CPU by default), so that only the batching differs.
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=4096,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        flash_attn=True,
        logits_all=logits_all,
        verbose=False,
    )


def bench_weights(
    path: Path, passages: list[str], args: argparse.Namespace, *, pack: bool
) -> dict[str, list[StepResult]]:
    engine = LlamaEngine(
        path,
        n_ctx=4096,
        n_seq_max=max(8, len(passages)),
        n_threads=args.threads,
        n_batch=512,
        model_id=path.name,
    )
    llm = _llama(path, args, logits_all=False)
    pack_llm = _llama(path, args, logits_all=True) if pack else None
    try:
        prompts, shared = build_prompts(engine, passages, args.prompt_tokens)
        print(
            f"\n{path.name}: {len(prompts)} branches, prompts of {len(prompts[0])} tokens "
            f"({shared} shared), {args.gen} generated tokens each, {args.threads} threads"
        )
        runs: dict[str, list[StepResult]] = {"a": [], "a0": [], "b": [], "c": []}
        run_sequential(llm, prompts, args.gen)  # warm-up: page in the weights
        run_batched(engine, prompts, args.gen, share_prefix=True)
        if pack_llm is None:
            del runs["a"]
        for rep in range(args.reps):
            # The pack's configuration is an order of magnitude slower: fewer repetitions, still
            # interleaved with the others so that outside load hits all variants alike.
            if pack_llm is not None and rep < args.pack_reps:
                runs["a"].append(run_sequential(pack_llm, prompts, args.gen, args.pack_logprobs))
            runs["a0"].append(run_sequential(llm, prompts, args.gen))
            runs["b"].append(run_batched(engine, prompts, args.gen, share_prefix=False))
            runs["c"].append(run_batched(engine, prompts, args.gen, share_prefix=True))
        return runs
    finally:
        llm.close()
        if pack_llm is not None:
            pack_llm.close()
        engine.close()


def print_table(runs: dict[str, list[StepResult]]) -> dict[str, float]:
    labels = {
        "a": "(a) pack: logits_all+logprobs",
        "a0": "(a0) create_completion x K",
        "b": "(b) one batch, no sharing",
        "c": "(c) one batch, shared prefix",
    }
    medians = {k: statistics.median(r.seconds for r in v) for k, v in runs.items()}
    base = "a" if "a" in runs else "a0"
    reference = runs["a0"][-1].outputs
    print(f"| {'variant':30} | median s | min s | vs (a) | prefill tok | decodes | same text |")
    print(f"|{'-' * 32}|---------:|------:|-------:|------------:|--------:|----------:|")
    for key, results in runs.items():
        last = results[-1]
        same = sum(o == r for o, r in zip(last.outputs, reference, strict=True))
        decodes = "-" if last.decode_calls < 0 else str(last.decode_calls)
        print(
            f"| {labels[key]:30} | {medians[key]:8.2f} | {min(r.seconds for r in results):5.2f} "
            f"| {medians[base] / medians[key]:5.2f}x | {last.prefill_tokens:11d} | {decodes:>7} "
            f"| {f'{same}/{len(reference)}':>9} |"
        )
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--home", type=Path, default=None, help="derived weights cache folder")
    parser.add_argument("--k", type=int, default=5, help="branches per step")
    parser.add_argument("--prompt-tokens", type=int, default=250)
    parser.add_argument("--gen", type=int, default=32, help="tokens generated per branch")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pack-reps", type=int, default=1, help="repetitions of (a)")
    parser.add_argument(
        "--pack-logprobs",
        type=int,
        default=20,
        help="logprobs per call in (a); the pack asks for the whole vocabulary (32016)",
    )
    args = parser.parse_args(argv)

    corpus = args.data / "wiki_sample_1000.jsonl"
    with corpus.open(encoding="utf-8") as fh:
        passages = [json.loads(line)["contents"] for line in itertools.islice(fh, args.k)]
    original = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        home = args.home or Path(tmp)
        derived = derive_weights(original, "auto", home)
        figures: dict[str, float] = {}
        for prefix, path in (("", derived), ("q41_", original)):
            medians = print_table(bench_weights(path, passages, args, pack=not prefix))
            for key, value in medians.items():
                figures[f"{prefix}{key}_s"] = value
            if "a" in medians:
                figures[f"{prefix}a_over_b"] = medians["a"] / medians["b"]
                figures[f"{prefix}a_over_c"] = medians["a"] / medians["c"]
            figures[f"{prefix}a0_over_c"] = medians["a0"] / medians["c"]
            figures[f"{prefix}b_over_c"] = medians["b"] / medians["c"]
    print()
    print(" ".join(f"{name}={value:.3f}" for name, value in figures.items()))


if __name__ == "__main__":
    main()
