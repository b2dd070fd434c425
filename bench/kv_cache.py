"""Passage KV-state cache benchmark: one branch step over the same passages, cold vs warm.

One decoder step has one question and K evidence branches, one per retrieved passage. Here the
K passages are the first K paragraphs of the Normans article (the tuning split) and every step
asks a different question about them (the questions of those paragraphs, in turn), with the
default (likelihood) critique: relevance, a draft of `--draft` tokens, support and utility. Cold: an
empty prefix-state store. Warm: the store already holds every passage's template + passage
state, saved by a step with *other* questions. Before every step the engine's slots are
emptied, so a warm step gets its prefixes only from the store (as a fresh replica, or one whose
slots were evicted, would, with Redis behind the memory tier). Cold and warm steps alternate
so that load from other processes hits them alike. Reported: median seconds per branch step,
prompt tokens decoded, restores, and the warm/cold ratio. The last line holds the figures as
name=value pairs.

    .venv/bin/python -m bench.kv_cache [--data ../shared/data] [--k 4] [--reps 3] [--draft 16]
                                       [--join 1] [--threads 0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

from selfrag.infra.cache.kv_cache import TieredStateStore
from selfrag.infra.cache.tiers import MemoryLRU
from selfrag.infra.engine.llama_engine import LlamaEngine
from selfrag.infra.models.model_files import default_model_path, derive_weights
from selfrag.infra.settings_loader import load_settings
from selfrag.pipeline.critics import Branch, Critic, make_critic
from selfrag.pipeline.protocols import Passage


def squad_passages(
    path: Path, k: int, questions: int, join: int = 1
) -> tuple[list[Passage], list[str]]:
    """`k` passages of `join` consecutive paragraphs each from the first article, and
    `questions` answerable questions about them (taken from each paragraph in turn)."""
    article = json.loads(path.read_text())["data"][0]
    title = article["title"].replace("_", " ")
    paras = article["paragraphs"][: k * join]
    passages = [
        Passage(
            f"{title}#{n}",
            "\n".join(p["context"] for p in paras[n * join : (n + 1) * join]),
            title,
        )
        for n in range(len(paras) // join)
    ]
    per_para = [[qa["question"] for qa in p["qas"] if not qa.get("is_impossible")] for p in paras]
    asked = [q for row in zip(*per_para, strict=False) for q in row][:questions]
    if len(passages) < k or len(asked) < questions:
        raise SystemExit(f"{path}: fewer than {k} paragraphs or {questions} questions")
    return passages, asked


def branch_step(critic: Critic, branches: list[Branch], draft_tokens: int) -> list[float]:
    """What the decoder runs for one segment of K evidence branches; returns the seconds of
    each call: relevance (prefill only, where the passage prefix is all the difference), draft,
    support and utility."""
    marks = [time.perf_counter()]
    critic.relevance(branches)
    marks.append(time.perf_counter())
    drafts = critic.draft(branches, draft_tokens)
    marks.append(time.perf_counter())
    critic.support(branches, drafts)
    marks.append(time.perf_counter())
    critic.utility(branches, drafts)
    marks.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(marks)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--k", type=int, default=4, help="Branches (passages) per step.")
    ap.add_argument("--reps", type=int, default=3, help="Cold and warm steps each.")
    ap.add_argument("--draft", type=int, default=16, help="Draft tokens per branch.")
    ap.add_argument(
        "--join", type=int, default=1, help="Consecutive paragraphs per passage (longer passages)."
    )
    ap.add_argument("--threads", type=int, default=0, help="0: all cores.")
    args = ap.parse_args()

    passages, questions = squad_passages(
        args.data / "squad_v2_small.json", args.k, 2 * args.reps + 1, args.join
    )
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
        passage_tokens = statistics.mean(len(engine.tokenize(p.text)) for p in passages)

        def step(question: str, store: TieredStateStore) -> tuple[float, list[float], int, int]:
            branches = [Branch(question, "", p) for p in passages]
            engine.prefix_store = store
            engine.clear_cache()
            engine.reset_stats()
            t0 = time.perf_counter()
            phases = branch_step(critic, branches, args.draft)
            dt = time.perf_counter() - t0
            s = engine.stats
            return dt, phases, s.prefill_tokens, s.kv_restores

        warm_store = TieredStateStore(MemoryLRU(1 << 30))
        step(questions[0], warm_store)  # fills the store (and warms the process)
        cold: list[tuple[float, list[float], int, int]] = []
        warm: list[tuple[float, list[float], int, int]] = []
        # Each question is asked once, cold or warm, so no answer comes from an earlier step.
        for r in range(args.reps):
            cold.append(step(questions[1 + 2 * r], TieredStateStore(MemoryLRU(1 << 30))))
            warm.append(step(questions[2 + 2 * r], warm_store))
        engine.close()

    k = args.k
    rows = []
    for name, runs in (("cold", cold), ("warm", warm)):
        phases = [statistics.median(r[1][i] for r in runs) / k for i in range(4)]
        step_s = statistics.median(r[0] for r in runs) / k
        rows.append((name, step_s, phases, statistics.median(r[2] for r in runs), runs[-1][3]))
    print(
        f"K={k} passages of {passage_tokens:.0f} tokens on average, draft {args.draft} tokens, "
        f"{engine.n_threads} thread(s), {weights.name}"
    )
    print("seconds per branch (medians over steps / K):")
    print(
        f"{'cache':<6} {'step':>7} {'relevance':>10} {'draft':>7} {'support':>8} "
        f"{'utility':>8} {'prefill tok/step':>17} {'restores/step':>14}"
    )
    for name, step_s, ph, prefill, restores in rows:
        print(
            f"{name:<6} {step_s:>7.3f} {ph[0]:>10.3f} {ph[1]:>7.3f} {ph[2]:>8.3f} {ph[3]:>8.3f} "
            f"{prefill:>17.0f} {restores:>14}"
        )
    ratio = rows[0][1] / rows[1][1]
    rel_ratio = rows[0][2][0] / rows[1][2][0]
    print(f"warm is {ratio:.2f}x faster per branch step, {rel_ratio:.2f}x on its prefill call")
    print(
        f"passage_tokens={passage_tokens:.0f} kv_cold_s_per_branch={rows[0][1]:.4f} "
        f"kv_warm_s_per_branch={rows[1][1]:.4f} "
        f"kv_warm_speedup={ratio:.2f} kv_warm_prefill_call_speedup={rel_ratio:.2f} "
        f"kv_cold_prefill={rows[0][3]:.0f} kv_warm_prefill={rows[1][3]:.0f} "
        f"kv_warm_restores={rows[1][4]}"
    )


if __name__ == "__main__":
    main()
