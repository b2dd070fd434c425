"""Self-RAG at the price of vanilla RAG? Four systems side by side in one run, each behind an
HTTP endpoint, on the same questions, model, index and K = 3, at 1 and 4 concurrent clients:

(a) vanilla RAG: the top 3 passages in one prompt, one generation (`pipeline.evaluation.baselines`);
(b) Self-RAG as the LlamaIndex pack runs it: one `create_completion` per branch, each with
    `logprobs` on a `Llama(logits_all=True)`, the question first and the passage after it, plus
    the retrieval-decision call; the branch with the best mean token log-probability wins;
(c) selfrag (`selfrag serve`, `mode always`) with an empty passage KV store: its disk tier is
    emptied and the server restarted before each level;
(d) selfrag with the disk tier warm (filled by (c)), after a restart.

(a) and (b) run in a child process serving both over HTTP (`--serve-baselines`); (c) and (d) are
`selfrag serve`. Only one holds the embedded index at a time. The query cache is off, and the
baselines' KV cache is emptied before each level (the levels ask the same questions; a whole
prompt left from the level before would be a query-cache hit), so every answer is computed.
Reported per system and level: p50/p95 latency, answers/s, prefill and
decode tokens per answer, accuracy (the answer contains a gold answer, answerable held-out
questions) and the share of answers that abstained (vanilla RAG's "I don't know"),
and as the physical reference the engine's prefill tokens/s and decode ms/token on this CPU.
Last line: name=value.

With `--long-form SET` (a long-form set of `bench/data/`), long answers instead: vanilla RAG's
long-form prompt (`vanilla-rag-long`) against selfrag with the product's defaults, cold then
warm, one client, each within the same token budget (`max_segments` × `max_segment_tokens`);
"acc" is then the share of a question's facts the answer states.

    .venv/bin/python -m bench.vs_vanilla --home ~/.local/share/selfrag --questions 40
    .venv/bin/python -m bench.vs_vanilla --home HOME --long-form bench/data/longform_wiki.jsonl
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.serve_load import served, wait_ready
from selfrag.pipeline.evaluation.longform_metrics import Fact, judge_answer
from selfrag.pipeline.evaluation.qa_metrics import contains_answer

K = 3
MAX_TOKENS = 48
SELFRAG_CONFIG = {"mode": "always", "top_k": K, "max_segments": 1, "max_segment_tokens": MAX_TOKENS}
HELD_OUT = "Computational_complexity_theory"
LEVELS = (1, 4)

Score = Callable[[str], float]
"""How right an answer's text is, in [0, 1]."""
Question = tuple[str, Score]


@dataclass
class Result:
    seconds: float
    score: float
    prefill: int
    decode: int
    abstained: bool


def held_out_questions(data: Path, n: int) -> list[Question]:
    """The first `n` answerable held-out questions, each scored 1 when a gold answer is
    stated."""
    from selfrag.jobs.evaluation.eval_questions import load_questions

    qs = load_questions(data / "squad_v2_small.json", article=HELD_OUT)
    return [
        (q.question, lambda a, g=q.golds: float(contains_answer(a, g))) for q in qs if q.answerable
    ][:n]


def long_form_questions(path: Path, split: str, n: int) -> list[Question]:
    """The first `n` questions of a long-form set's `split`, each scored by the share of its
    facts the answer states (`[n]` markers aside)."""
    from selfrag.jobs.evaluation.eval_questions import load_questions

    def share(answer: str, facts: Sequence[Fact]) -> float:
        return len(judge_answer(answer, (), {}, facts, abstained=False).stated) / len(facts)

    qs = load_questions(path, split=split, limit=n)
    return [(q.question, lambda a, f=q.facts: share(a, f)) for q in qs]


# --- the baselines' server (a child process) ---------------------------------------------------


def serve_baselines(home: str, port: int) -> None:
    """(a) and (b) over HTTP: POST /vanilla, /pack {"question"}; GET /reference, /ready."""
    from selfrag.infra.engine.engine_threads import apply_wait_policy
    from selfrag.infra.settings_loader import load_settings

    settings = load_settings(environ={**os.environ, "SELFRAG_HOME": home})
    # Before llama.cpp's OpenMP runtime loads (with llama_cpp): the baselines' threads wait as
    # selfrag's engines do, whatever the environment this bench started in says.
    apply_wait_policy(settings.model.omp_wait_policy)

    import llama_cpp
    import uvicorn
    from fastapi import FastAPI

    from selfrag.pipeline.evaluation.baselines import BaselineAnswerer
    from selfrag.runtime.system import LocalRuntime
    from selfrag.schemas.decoding import DecodingConfig

    rag = LocalRuntime(settings)
    vanilla = BaselineAnswerer(rag.engine, rag.store)
    config = DecodingConfig(top_k=K, max_segments=1, max_segment_tokens=MAX_TOKENS)
    long_config = DecodingConfig(top_k=K)  # selfrag's default budget of a long answer
    # The pack's engine: llama-cpp-python's high-level Llama with every logit kept.
    llm = llama_cpp.Llama(
        model_path=str(rag.model.path),
        n_ctx=settings.model.n_ctx,
        n_threads=settings.model.n_threads or os.cpu_count() or 1,
        logits_all=True,
        verbose=False,
    )
    engine_lock = threading.Lock()  # one engine call at a time, as each engine serialises
    app = FastAPI()

    def pack(question: str) -> dict[str, Any]:
        prefill = decode = 0

        def complete(prompt: str, max_tokens: int) -> tuple[str, float]:
            nonlocal prefill, decode
            out: Any = llm.create_completion(
                prompt, max_tokens=max_tokens, temperature=0.0, logprobs=1
            )
            prefill += out["usage"]["prompt_tokens"]
            decode += out["usage"]["completion_tokens"]
            lps = [lp for lp in out["choices"][0]["logprobs"]["token_logprobs"] if lp is not None]
            return out["choices"][0]["text"], (sum(lps) / len(lps) if lps else -99.0)

        head = f"### Instruction:\n{question}\n\n### Response:\n"
        with engine_lock:
            complete(head, 1)  # the retrieval decision: the first token's probabilities
            passages = rag.store.search(question, K)
            best = ("", -1e9)
            for p in passages:
                text, score = complete(
                    f"{head}[Retrieval]<paragraph>{p.text}</paragraph>", MAX_TOKENS
                )
                if score > best[1]:
                    best = (text, score)
        return {
            "answer": best[0].strip(),
            "abstained": False,  # the pack has no way to decline
            "prefill_tokens": prefill,
            "decode_tokens": decode,
        }

    def vanilla_reply(question: str, long_form: bool) -> dict[str, Any]:
        with engine_lock:
            r = vanilla.answer(
                question, long_config if long_form else config, retrieve=True, long_form=long_form
            )
        return {
            "answer": r.answer,
            "abstained": r.abstained,  # its "I don't know"
            "prefill_tokens": r.usage.prefill_tokens,
            "decode_tokens": r.usage.decode_tokens,
        }

    @app.post("/vanilla")
    def vanilla_answer(body: dict[str, str]) -> dict[str, Any]:
        return vanilla_reply(body["question"], long_form=False)

    @app.post("/vanilla-long")
    def vanilla_long_answer(body: dict[str, str]) -> dict[str, Any]:
        return vanilla_reply(body["question"], long_form=True)

    @app.post("/pack")
    def pack_answer(body: dict[str, str]) -> dict[str, Any]:
        return pack(body["question"])

    @app.post("/reset")
    def reset() -> dict[str, bool]:
        """Forget earlier prompts: each level asks the same questions again, and a prompt
        still in the KV cache would be a query-cache hit (selfrag's query cache is off)."""
        with engine_lock:
            rag.engine.clear_cache()
            llm.reset()
        return {"reset": True}

    @app.get("/reference")
    def reference() -> dict[str, float]:
        with engine_lock:
            return engine_reference(rag.engine)

    @app.get("/ready")
    def ready() -> dict[str, bool]:
        return {"ready": True}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def engine_reference(engine: Any) -> dict[str, float]:
    """The engine's best: prefill tokens/s on a 512-token prompt, decode ms/token over 64
    tokens of one sequence (a `LlamaEngine`; its KV cache is cleared)."""
    from selfrag.pipeline.protocols import GenerationRequest

    prompt = engine.tokenize("The history of Normandy. " * 100)[:512]
    engine.clear_cache()
    started = time.perf_counter()
    engine.generate([GenerationRequest(prompt, 1, stop_at_sentence_end=False)])
    prefill_s = time.perf_counter() - started
    engine.clear_cache()
    started = time.perf_counter()
    (gen,) = engine.generate([GenerationRequest(prompt[:16], 64, stop_at_sentence_end=False)])
    decode_s = time.perf_counter() - started
    return {
        "prefill_tok_s": len(prompt) / prefill_s,
        "decode_ms_per_token": 1000 * decode_s / max(1, len(gen.tokens)),
    }


@contextmanager
def baselines(home: str, port: int) -> Iterator[str]:
    cmd = [sys.executable, "-m", "bench.vs_vanilla", "--serve-baselines", "--home", home]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)], stdout=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 300, "/ready")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


# --- the client side ---------------------------------------------------------------------------


def ask_baseline(url: str, route: str, question: str, score: Score) -> Result:
    started = time.perf_counter()
    r = httpx.post(f"{url}/{route}", json={"question": question}, timeout=600)
    r.raise_for_status()
    body = r.json()
    return Result(
        time.perf_counter() - started,
        0.0 if body["abstained"] else score(body["answer"]),
        body["prefill_tokens"],
        body["decode_tokens"],
        body["abstained"],
    )


def ask_selfrag(
    url: str, question: str, score: Score, config: dict[str, Any] = SELFRAG_CONFIG
) -> Result:
    started = time.perf_counter()
    r = httpx.post(url + "/v1/answer", json={"question": question, "config": config}, timeout=600)
    r.raise_for_status()
    body = r.json()
    u = body["usage"]
    return Result(
        time.perf_counter() - started,
        0.0 if body["abstained"] else score(body["answer"]),
        u["prefill_tokens"],
        u["decode_tokens"],
        body["abstained"],
    )


def level(ask: Any, qs: Sequence[Question], clients: int) -> dict[str, float]:
    """Every question once, `clients` at a time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda q: ask(q[0], q[1]), qs))
    wall = time.perf_counter() - started
    secs = sorted(r.seconds for r in results)
    n = len(results)
    return {
        "p50_s": statistics.median(secs),
        "mean_s": statistics.mean(secs),
        "p95_s": secs[min(n - 1, int(0.95 * n))],
        "answers_per_s": n / wall,
        "prefill": statistics.mean(r.prefill for r in results),
        "decode": statistics.mean(r.decode for r in results),
        "accuracy": sum(r.score for r in results) / n,
        "abstained": sum(r.abstained for r in results) / n,
        "first_s": results[0].seconds,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--home", required=True, help="An indexed SELFRAG_HOME (SQuAD + wiki).")
    p.add_argument(
        "--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data"
    )
    p.add_argument("--questions", type=int, default=40)
    p.add_argument(
        "--long-form",
        type=Path,
        metavar="SET",
        help="Long answers: a long-form set (bench/data/longform_*.jsonl) whose corpus the "
        "home indexes; vanilla-rag-long against selfrag's defaults, one client.",
    )
    p.add_argument("--split", choices=("tune", "report"), default="report")
    p.add_argument(
        "--pack-questions",
        type=int,
        help="Run the pack (b) on the first N questions only (default: all; it is ~10x slower).",
    )
    p.add_argument(
        "--max-drafts",
        type=int,
        help="Self-RAG's draft budget per step (`max_drafts`; default: the product's; 50: no "
        "budget, every branch the relevance filters keep drafts).",
    )
    p.add_argument(
        "--retry-flagged",
        action="store_true",
        help="Self-RAG also retries drafts that pass the hard filters flagged (`retry_flagged`; "
        "default: the product's).",
    )
    p.add_argument("--port", type=int, default=8771)
    p.add_argument("--serve-baselines", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    home = str(Path(args.home).expanduser())
    if args.serve_baselines:
        serve_baselines(home, args.port)
        return 0
    long_form = args.long_form is not None
    if long_form:
        qs = long_form_questions(args.long_form, args.split, args.questions)
        config: dict[str, Any] = {"top_k": K}
        levels: tuple[int, ...] = (1,)
        baseline_routes = (("vanilla", "vanilla-long", qs),)
    else:
        qs = held_out_questions(args.data, args.questions)
        config = dict(SELFRAG_CONFIG)
        levels = LEVELS
        pack_qs = qs[: args.pack_questions or len(qs)]
        baseline_routes = (("vanilla", "vanilla", qs), ("pack", "pack", pack_qs))
    if len(qs) < args.questions and not long_form:
        p.error(f"only {len(qs)} answerable held-out questions")
    os.environ["SELFRAG_CACHE__QUERY"] = "false"  # every answer computed
    out: dict[str, dict[int, dict[str, float]]] = {}
    warm_q: Question = ("What is the capital of France?", lambda _: 0.0)
    if args.max_drafts is not None:
        config["max_drafts"] = args.max_drafts
    if args.retry_flagged:
        config["retry_flagged"] = True

    def ask(url: str) -> Any:
        return lambda q, score: ask_selfrag(url, q, score, config)

    kind = f"{args.long_form.name} {args.split}" if long_form else "held-out"
    print(
        f"{len(qs)} {kind} questions, K={K}, "
        f"{'the default budget' if long_form else f'{MAX_TOKENS} answer tokens'}, "
        f"max_drafts={config.get('max_drafts', 'default')}, "
        f"retry_flagged={config.get('retry_flagged', 'default')}",
        flush=True,
    )
    with baselines(home, args.port) as url:
        reference = httpx.get(url + "/reference", timeout=600).json()
        for system, route, some in baseline_routes:
            ask_baseline(url, route, *warm_q)
            out[system] = {}
            for c in levels:
                httpx.post(url + "/reset", timeout=60).raise_for_status()
                out[system][c] = level(
                    lambda q, score, r=route: ask_baseline(url, r, q, score), some, c
                )
            print(f"  {system}: done", flush=True)
    kv = Path(home) / "kv"
    out["cold"] = {}
    for c in levels:
        shutil.rmtree(kv, ignore_errors=True)  # an empty disk tier, and a fresh process
        with served(home, args.port, None) as (url, _):
            out["cold"][c] = level(ask(url), qs, c)
        print(f"  selfrag cold, {c} client(s): done", flush=True)
    with served(home, args.port, None) as (url, _):  # restarted: only the disk tier is warm
        out["warm"] = {c: level(ask(url), qs, c) for c in levels}
    print("  selfrag warm: done\n", flush=True)

    print(
        f"engine: prefill {reference['prefill_tok_s']:.0f} tokens/s, "
        f"decode {reference['decode_ms_per_token']:.1f} ms/token"
    )
    head = f"{'system':<8} {'clients':>7} {'p50 s':>7} {'p95 s':>7} {'ans/s':>7} {'prefill':>8}"
    print(head + f" {'decode':>7} {'acc':>6} {'abst':>6} {'first s':>8}")
    for system, by_level in out.items():
        for c, r in by_level.items():
            print(
                f"{system:<8} {c:>7} {r['p50_s']:>7.2f} {r['p95_s']:>7.2f} "
                f"{r['answers_per_s']:>7.3f} {r['prefill']:>8.0f} {r['decode']:>7.0f} "
                f"{r['accuracy']:>6.3f} {r['abstained']:>6.3f} {r['first_s']:>8.2f}"
            )
    print(" ".join(f"{k}={v}" for k, v in figures(out, reference, len(qs)).items()))
    return 0


def figures(
    out: dict[str, dict[int, dict[str, float]]], reference: dict[str, float], questions: int
) -> dict[str, str]:
    """The run's name=value figures: every system's at every level, then the ratios at one
    client (and at four, and the pack's, where the run has them)."""
    fig = {
        "questions": str(questions),
        "prefill_tok_s": f"{reference['prefill_tok_s']:.0f}",
        "decode_ms_per_token": f"{reference['decode_ms_per_token']:.2f}",
    }
    for system, by_level in out.items():
        for c, r in by_level.items():
            fig[f"{system}_p50_s_c{c}"] = f"{r['p50_s']:.2f}"
            fig[f"{system}_acc_c{c}"] = f"{r['accuracy']:.3f}"
            fig[f"{system}_abst_c{c}"] = f"{r['abstained']:.3f}"
    one = {s: out[s][1]["p50_s"] for s in out}
    mean_s = {s: out[s][1]["mean_s"] for s in out}
    acc = {s: out[s][1]["accuracy"] for s in out}

    def tokens(system: str, kind: str) -> float:
        """`system`'s tokens of `kind` per answer over vanilla's, at one client."""
        return out[system][1][kind] / max(out["vanilla"][1][kind], 1e-9)

    fig |= {f"{s}_p50_s": f"{one[s]:.2f}" for s in out}
    fig |= {
        "warm_over_vanilla": f"{one['warm'] / one['vanilla']:.2f}",
        "warm_mean_over_vanilla": f"{mean_s['warm'] / mean_s['vanilla']:.2f}",
        "warm_prefill_over_vanilla": f"{tokens('warm', 'prefill'):.2f}",
        "warm_decode_over_vanilla": f"{tokens('warm', 'decode'):.2f}",
        "warm_acc_minus_vanilla": f"{acc['warm'] - acc['vanilla']:+.3f}",
        "warm_first_over_p50": f"{out['warm'][1]['first_s'] / one['warm']:.2f}",
    }
    if 4 in out["warm"]:
        fig["warm_answers_s_over_vanilla_c4"] = (
            f"{out['warm'][4]['answers_per_s'] / out['vanilla'][4]['answers_per_s']:.2f}"
        )
    if "pack" in out:
        fig["pack_over_warm"] = f"{one['pack'] / one['warm']:.2f}"
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
