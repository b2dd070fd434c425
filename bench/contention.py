"""Engine threads on shared cores: a branch step and a whole answer, quiet and beside a busy
neighbour process, for llama.cpp's and libgomp's own defaults and the shipped settings,
side by side.

Each configuration (llama.cpp threads, OpenMP wait policy) runs in a worker process of its
own, started with the environment that configuration gives an engine process (OpenMP reads its
wait policy once, when it loads): "default" is llama.cpp's and libgomp's own defaults
(`n_threads` 0, all cores; `OMP_WAIT_POLICY` unset, so libgomp spins about 300,000 rounds
before it sleeps), "chosen" the settings' defaults now; `--candidate NAME=THREADS:POLICY`
adds others. (A candidate with the `active` policy spins in its idle workers between turns,
for ever: it is a busy neighbour of every other configuration's quiet turns, so measure it in
a run of its own.)

The workers open copies of one indexed home (embedded Qdrant allows one process per folder)
and answer through the Python API with the query cache off. Turns are interleaved: each
repetition runs a quiet phase and then a loaded phase, and in each phase every worker in turn
(the order rotating) times one branch step (bench/branches.py's variant (c): K passages of one
question in one multi-sequence batch, shared prefix decoded once, cold cache) and one whole
answer. In a loaded phase a neighbour process runs a bounded busy loop (it ends itself after
`--neighbour-max-s`; the script stops it by its pid when the phase is over).

Reported per configuration: median seconds quiet and loaded, and loaded over quiet. The last
line holds the figures as name=value pairs: `loaded_over_quiet` (answer p50 under the
neighbour over quiet, chosen settings) and `default_loaded_over_quiet`, and the rest.

    .venv/bin/python -m bench.contention [--reps 5] [--home INDEXED_HOME]
        [--candidate t1=1:passive --candidate t2active=2:active]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from selfrag.schemas.settings import ModelSettings

ROOT = Path(__file__).resolve().parents[1]
# A CPU-bound neighbour: one Python thread spinning until its deadline.
BUSY_LOOP = (
    "import sys, time\n"
    "end = time.monotonic() + float(sys.argv[1])\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
)
# Variables that change how the OpenMP runtime waits; a worker gets only its configuration's.
OPENMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
ANSWER_DIALS: dict[str, Any] = {"mode": "always"}  # retrieval and branches on every question


@dataclass
class Config:
    """One engine configuration: its threads and OpenMP wait policy."""

    name: str
    n_threads: int
    policy: str
    times: dict[str, list[float]] = field(default_factory=dict)

    def record(self, key: str, seconds: float) -> None:
        self.times.setdefault(key, []).append(seconds)

    def p50(self, key: str) -> float:
        return statistics.median(self.times[key])


def parse_candidate(text: str) -> Config:
    name, _, spec = text.partition("=")
    threads, _, policy = spec.partition(":")
    if not name or not threads.isdigit() or policy not in ("passive", "active", "inherit"):
        raise argparse.ArgumentTypeError(f"expected NAME=THREADS:passive|active|inherit: {text}")
    return Config(name, int(threads), policy)


# --- the worker process --------------------------------------------------------------------------


def worker(spec: dict[str, Any]) -> None:
    """Open the home with this configuration, warm up, then time what stdin asks for."""
    from selfrag import SelfRAG
    from selfrag.infra.engine.engine_threads import WAIT_POLICY_ENV, loaded_openmp

    rag = SelfRAG.open(
        spec["home"],
        cache={"query": False},
        model={"n_threads": spec["n_threads"], "omp_wait_policy": spec["policy"]},
    )
    engine = rag.system.engine
    from bench.branches import build_prompts, run_batched  # imports llama_cpp: after the engine

    prompts, _ = build_prompts(engine, spec["passages"], spec["prompt_tokens"])
    questions = spec["questions"]

    def branch() -> float:
        share, cache = engine.share_prefix, engine.prefix_cache
        try:
            return run_batched(engine, prompts, spec["gen"], share_prefix=True).seconds
        finally:
            engine.share_prefix, engine.prefix_cache = share, cache

    def answer(i: int) -> float:
        start = time.perf_counter()
        rag.answer(questions[i % len(questions)], **ANSWER_DIALS)
        return time.perf_counter() - start

    branch()
    for i in range(len(questions)):  # passage KV states and the embedder warm for every turn
        answer(i)
    ready = {
        "threads": engine.n_threads,
        WAIT_POLICY_ENV: os.environ.get(WAIT_POLICY_ENV),
        "openmp": loaded_openmp(),
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        kind, _, arg = line.strip().partition(" ")
        if kind == "branch":
            print(json.dumps(branch()), flush=True)
        elif kind == "answer":
            print(json.dumps(answer(int(arg))), flush=True)
        else:
            break
    rag.close()


# --- the driver ---------------------------------------------------------------------------------


class Worker:
    """A worker process of one configuration, driven line by line."""

    def __init__(self, config: Config, spec: dict[str, Any], log: TextIO) -> None:
        env = {k: v for k, v in os.environ.items() if k not in OPENMP_ENV}
        env = {k: v for k, v in env.items() if not k.startswith("SELFRAG_MODEL__")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        full = {**spec, "n_threads": config.n_threads, "policy": config.policy}
        self.config = config
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.contention", "--worker", json.dumps(full)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.ready = json.loads(self._read())

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.config.name} died (exit {self.proc.wait()}); see log")
        return line

    def ask(self, command: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return float(json.loads(self._read()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@contextmanager
def neighbour(max_s: float) -> Iterator[subprocess.Popen[bytes]]:
    """A CPU-bound process for the length of the block (and at most `max_s`), stopped by pid."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(max_s)])
    try:
        time.sleep(0.2)  # running before the first turn
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait()


def load_average() -> float:
    return os.getloadavg()[0]


def index_home(home: Path, data: Path) -> None:
    """The Normans paragraphs of the SQuAD sample (the tuning split), indexed into `home`."""
    from selfrag import SelfRAG

    squad = json.loads((data / "squad_v2_small.json").read_text(encoding="utf-8"))
    squad["data"] = [a for a in squad["data"] if a["title"] == "Normans"]
    path = home.parent / "normans.json"
    path.write_text(json.dumps(squad), encoding="utf-8")
    with SelfRAG.open(home, model={"n_threads": 1}) as rag:
        rag.index(path)


def normans_questions(data: Path, n: int) -> list[str]:
    squad = json.loads((data / "squad_v2_small.json").read_text(encoding="utf-8"))
    [article] = [a for a in squad["data"] if a["title"] == "Normans"]
    qs = [q["question"] for p in article["paragraphs"] for q in p["qas"] if not q["is_impossible"]]
    return qs[:n]


def home_copy(base: Path, target: Path) -> Path:
    """A copy of an indexed home for one worker; derived model weights shared (a link)."""
    shutil.copytree(base, target, ignore=shutil.ignore_patterns("models", "kv"))
    (base / "models").mkdir(exist_ok=True)
    (target / "models").symlink_to(base / "models", target_is_directory=True)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--home", type=Path, help="an indexed home (default: Normans, indexed)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--questions", type=int, default=3, help="Normans questions cycled")
    parser.add_argument("--k", type=int, default=5, help="branches in the branch step")
    parser.add_argument("--prompt-tokens", type=int, default=250)
    parser.add_argument("--gen", type=int, default=32, help="tokens drafted per branch")
    parser.add_argument("--neighbour-max-s", type=float, default=600.0)
    parser.add_argument(
        "--candidate", type=parse_candidate, action="append", default=[], help="NAME=T:POLICY"
    )
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return

    # SIGTERM unwinds like Ctrl-C, so the neighbour and the workers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shipped = ModelSettings()
    configs = [
        Config("default", 0, "inherit"),
        Config("chosen", shipped.n_threads, shipped.omp_wait_policy),
        *args.candidate,
    ]
    with (args.data / "wiki_sample_1000.jsonl").open(encoding="utf-8") as fh:
        passages = [json.loads(next(fh))["contents"] for _ in range(args.k)]
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="contention-") as tmp:
        base = args.home
        if base is None:
            base = Path(tmp) / "base"
            index_home(base, args.data)
        spec = {
            "passages": passages,
            "prompt_tokens": args.prompt_tokens,
            "gen": args.gen,
            "questions": normans_questions(args.data, args.questions),
        }
        log_path = Path(tmp) / "workers.log"
        workers: list[Worker] = []
        with log_path.open("w") as log:
            try:
                for c in configs:  # one at a time: the first derives the weights the rest share
                    home = home_copy(base, Path(tmp) / c.name)
                    workers.append(Worker(c, {**spec, "home": str(home)}, log))
                    print(f"{c.name}: {c.n_threads} -> {workers[-1].ready}", flush=True)
                run_turns(workers, args)
            except BaseException:
                print(log_path.read_text()[-4000:], file=sys.stderr)
                raise
            finally:
                for w in workers:
                    w.close()
    report(configs, load_start, load_average())


def run_turns(workers: list[Worker], args: argparse.Namespace) -> None:
    for rep in range(args.reps):
        order = workers[rep % len(workers) :] + workers[: rep % len(workers)]
        for phase in ("quiet", "loaded"):
            busy = neighbour(args.neighbour_max_s) if phase == "loaded" else nullcontext(None)
            with busy as proc:
                for w in order:
                    w.config.record(f"branch_{phase}", w.ask("branch"))
                    w.config.record(f"answer_{phase}", w.ask(f"answer {rep}"))
                    if proc is not None and proc.poll() is not None:
                        raise SystemExit("the neighbour ended mid-phase: raise --neighbour-max-s")
        print(
            f"rep {rep + 1}/{args.reps}: "
            + ", ".join(
                f"{w.config.name} answer {w.config.times['answer_quiet'][-1]:.2f}/"
                f"{w.config.times['answer_loaded'][-1]:.2f} s"
                for w in workers
            ),
            flush=True,
        )


def report(configs: list[Config], load_start: float, load_end: float) -> None:
    print(
        "\n| config | threads | wait policy | branch quiet s | branch loaded s | loaded/quiet "
        "| answer quiet s | answer loaded s | loaded/quiet |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    figures: dict[str, float] = {}
    for c in configs:
        row = [c.name, str(c.n_threads or f"0 ({os.cpu_count()})"), c.policy]
        for what in ("branch", "answer"):
            quiet, loaded = c.p50(f"{what}_quiet"), c.p50(f"{what}_loaded")
            row += [f"{quiet:.2f}", f"{loaded:.2f}", f"{loaded / quiet:.2f}x"]
            prefix = "" if c.name == "chosen" else f"{c.name}_"
            stem = "" if what == "answer" else "branch_"
            figures[f"{prefix}{stem}loaded_over_quiet"] = loaded / quiet
            figures[f"{prefix}{what}_quiet_s"] = quiet
            figures[f"{prefix}{what}_loaded_s"] = loaded
        print("| " + " | ".join(row) + " |")
    figures["load1_start"] = load_start
    figures["load1_end"] = load_end
    print()
    print(" ".join(f"{k}={v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
