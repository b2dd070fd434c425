"""CLI start-up: how long `selfrag` takes outside the work it was asked to do.

`selfrag ask` is run `--runs` times (default 5) on a warm machine; each run's process wall
time minus the answer's own time (`timings_ms.total` of `--json`, the decode from the question
to the answer) is its overhead: interpreter and imports, settings, opening the store, loading
the embedder and the language model, and leaving. `selfrag status`, `selfrag config` and
`selfrag --help` are timed whole. Medians are reported; goals: ask overhead <= 3 s, the others
< 1 s. One llama.cpp thread (`SELFRAG_MODEL__N_THREADS=1`). Each process's CPU time (user +
system, its children included) is reported too: on a shared machine it moves less than the
wall time.

Without `--home`, the SQuAD sample (`squad_v2_small.json`) is indexed into a temporary home
first (not timed); the first `ask` of a fresh home also derives the model and probes the CPU
backend, so one unmeasured `ask` runs before the timed ones. Last line: name=value.

    .venv/bin/python -m bench.cli_start [--home H] [--data ../shared/data] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "Who was the Norse leader who founded Normandy?"
# The console script users run (`.venv/bin/selfrag`), beside this interpreter.
_SCRIPT = Path(sys.executable).with_name("selfrag")
SELFRAG = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "selfrag"]


def timed(args: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of one `selfrag` process (its children included);
    raises when it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_data = Path(__file__).resolve().parents[2] / "shared" / "data"
    parser.add_argument("--home", type=Path, help="an indexed SELFRAG_HOME (default: a new one)")
    parser.add_argument("--data", type=Path, default=default_data)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "SELFRAG_MODEL__N_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with tempfile.TemporaryDirectory() as tmp:
        home = args.home or Path(tmp) / "home"
        base = [*SELFRAG, "--home", str(home)]
        if args.home is None:
            timed([*base, "index", "--no-progress", str(args.data / "squad_v2_small.json")], env)
        timed([*base, "ask", QUESTION, "--json"], env)  # warm: derived model, probes, page cache

        python_s = [timed([sys.executable, "-c", "pass"], env)[0] for _ in range(args.runs)]
        walls, cpus, answers = [], [], []
        for _ in range(args.runs):
            wall, cpu, out = timed([*base, "ask", QUESTION, "--json"], env)
            walls.append(wall)
            cpus.append(cpu)
            answers.append(json.loads(out)["timings_ms"]["total"] / 1e3)
        overheads = [w - a for w, a in zip(walls, answers, strict=True)]
        others = {
            "status": [*base, "status"],
            "config": [*base, "config"],
            "help": [*SELFRAG, "--help"],
        }
        whole = {name: [timed(cmd, env) for _ in range(args.runs)] for name, cmd in others.items()}

    med = statistics.median
    print(f"python -c pass: {med(python_s):.2f} s (the interpreter's own floor)")
    print(f"{'command':<14} {'median s':>9} {'min s':>7} {'max s':>7}")
    rows = {
        "ask wall": walls,
        "ask answer": answers,
        "ask overhead": overheads,
        "ask cpu": cpus,
        **{name: [t[0] for t in runs] for name, runs in whole.items()},
        **{f"{name} cpu": [t[1] for t in runs] for name, runs in whole.items()},
    }
    for name, values in rows.items():
        print(f"{name:<14} {med(values):>9.2f} {min(values):>7.2f} {max(values):>7.2f}")
    figures = {
        "ask_overhead_s": med(overheads),
        "ask_wall_s": med(walls),
        "answer_s": med(answers),
        **{f"{name}_s": med([t[0] for t in runs]) for name, runs in whole.items()},
        "ask_cpu_s": med(cpus),
        **{f"{name}_cpu_s": med([t[1] for t in runs]) for name, runs in whole.items()},
        "python_s": med(python_s),
    }
    print(" ".join(f"{k}={v:.2f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
