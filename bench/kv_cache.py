"""Passage KV-state cache benchmark: one branch step over the same passages, cold vs warm.

K branches, each a different SQuAD paragraph, run one decoder step with the default
(likelihood) critique: relevance, a draft of `--draft` tokens, support and utility. Cold: an
empty prefix-state store. Warm: the store already holds every passage's template + passage
state, saved by a step with *other* questions. Before every step the engine's slots are
emptied, so a warm step gets its prefixes only from the store (as a fresh replica, or one whose
slots were evicted, would, with Redis behind the memory tier). Cold and warm steps alternate
so that load from other processes hits them alike. Reported: median seconds per branch step,
prompt tokens decoded, restores, and the warm/cold ratio. The last line holds the figures as
name=value pairs.

    .venv/bin/python -m bench.kv_cache [--data ../shared/data] [--k 4] [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from infra.cache import MemoryLRU
from infra.kv_cache import TieredStateStore
from infra.llama_engine import LlamaEngine
from infra.model_files import default_model_path, derive_weights
from infra.settings import load_settings
from pipeline.critique import Branch, Critic, make_critic
from pipeline.protocols import Passage


def squad_paragraphs(path: Path, k: int, questions: int) -> list[tuple[Passage, list[str]]]:
    """The first `k` paragraphs with at least `questions` questions each."""
    out: list[tuple[Passage, list[str]]] = []
    for article in json.loads(path.read_text())["data"]:
        for n, para in enumerate(article["paragraphs"]):
            qs = [qa["question"] for qa in para["qas"]]
            if len(qs) >= questions:
                title = article["title"].replace("_", " ")
                out.append((Passage(f"{title}#{n}", para["context"], title), qs))
            if len(out) == k:
                return out
    raise SystemExit(f"{path} has fewer than {k} paragraphs with {questions} questions")


def branch_step(critic: Critic, branches: list[Branch], draft_tokens: int) -> float:
    """What the decoder runs for one segment of K evidence branches; returns the seconds of its
    first call (relevance: prefill only, where the passage prefix is all the difference)."""
    t0 = time.perf_counter()
    critic.relevance(branches)
    first = time.perf_counter() - t0
    drafts = critic.draft(branches, draft_tokens)
    critic.support(branches, drafts)
    critic.utility(branches, drafts)
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--k", type=int, default=4, help="Branches (passages) per step.")
    ap.add_argument("--reps", type=int, default=3, help="Cold and warm steps each.")
    ap.add_argument("--draft", type=int, default=16, help="Draft tokens per branch.")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    paragraphs = squad_paragraphs(args.data / "squad_v2_small.json", args.k, args.reps + 1)
    with tempfile.TemporaryDirectory() as home:
        settings = load_settings(environ={"SELFRAG_HOME": home})
        weights = derive_weights(default_model_path(), "auto", Path(home))
        engine = LlamaEngine(
            weights,
            n_ctx=4096,
            n_seq_max=16,
            n_threads=args.threads,
            n_batch=512,
            model_id="smollm2",
            prefix_store=TieredStateStore(MemoryLRU(1 << 30)),
            prefix_min_tokens=settings.cache.kv_min_tokens,
        )
        critic = make_critic(engine, "likelihood", settings.calibration)

        def step(question_index: int, store: TieredStateStore) -> tuple[float, float, int, int]:
            branches = [Branch(qs[question_index], "", p) for p, qs in paragraphs]
            engine.prefix_store = store
            engine.clear_cache()
            engine.reset_stats()
            t0 = time.perf_counter()
            first = branch_step(critic, branches, args.draft)
            dt = time.perf_counter() - t0
            s = engine.stats
            return dt, first, s.prefill_tokens, s.kv_restores

        warm_store = TieredStateStore(MemoryLRU(1 << 30))
        step(0, warm_store)  # fills the store (and warms the process) with question 0
        cold: list[tuple[float, float, int, int]] = []
        warm: list[tuple[float, float, int, int]] = []
        for r in range(1, args.reps + 1):
            cold.append(step(r, TieredStateStore(MemoryLRU(1 << 30))))
            warm.append(step(r, warm_store))
        engine.close()

    k = args.k
    rows = []
    for name, runs in (("cold", cold), ("warm", warm)):
        rows.append(
            (
                name,
                statistics.median(r[0] for r in runs) / k,
                statistics.median(r[1] for r in runs) / k,
                statistics.median(r[2] for r in runs),
                runs[-1][3],
            )
        )
    print(f"K={k} branches, draft {args.draft} tokens, {args.threads} thread(s), {weights.name}")
    print(
        f"{'cache':<6} {'s/branch step':>14} {'s/branch relevance':>19} "
        f"{'prefill tok/step':>17} {'restores/step':>14}"
    )
    for name, per_branch, rel, prefill, restores in rows:
        print(f"{name:<6} {per_branch:>14.3f} {rel:>19.3f} {prefill:>17.0f} {restores:>14}")
    ratio = rows[0][1] / rows[1][1]
    rel_ratio = rows[0][2] / rows[1][2]
    print(f"warm is {ratio:.2f}x faster per branch step, {rel_ratio:.2f}x on its prefill call")
    print(
        f"kv_cold_s_per_branch={rows[0][1]:.4f} kv_warm_s_per_branch={rows[1][1]:.4f} "
        f"kv_warm_speedup={ratio:.2f} kv_warm_prefill_call_speedup={rel_ratio:.2f} "
        f"kv_cold_prefill={rows[0][3]:.0f} kv_warm_prefill={rows[1][3]:.0f} "
        f"kv_warm_restores={rows[1][4]}"
    )


if __name__ == "__main__":
    main()
