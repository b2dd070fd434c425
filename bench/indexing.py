"""Indexing throughput: one process against `selfrag index --ray` with two Ray Data actors on
this machine, and against the same on a two-node loopback cluster (`--address`), side by side in
one run, each mode in a process of its own. `one` embeds on every core, as `selfrag index` does;
`one1` on one thread (the read-ahead alone); `one16` is `one` with the embedder in F16 whatever
the CPU (`retrieval.embedding_format`; `auto` may pick BF16); `before` runs `one` on another
checkout of selfrag (`--before DIR`, e.g. a worktree of an older commit): the documents/s before
and after a change.

The corpus is generated from the wiki sample (`wiki_sample_1000.jsonl`): its passages repeated
until there are `--passages` of them, each copy's text ending with its copy number, so every
passage is embedded (none is a duplicate id). Each mode indexes it into a fresh embedded store,
one embedding thread per actor. `ray` includes starting and stopping the private Ray
instance; `cluster` runs against a head and a worker node of one CPU each, started before it
(`tests.ray_cluster`) inside a network namespace that holds only loopback (`tests.netns`; needs
root, else the mode is skipped). Memory: the driver's peak RSS, and the peak of the summed RSS
of the driver and every process under it or the cluster's nodes (Ray's GCS, raylets, workers),
sampled every 0.2 s. CPU s: the indexing's CPU time in its process, every thread's (on a
machine other processes load, a process of more threads gets more of the cores, so compare the
wall times only on an idle one).

Last line: name=value.

    .venv/bin/python -m bench.indexing [--passages 10000] [--actors 2] [--data ../shared/data]
        [--modes before,one,one16,one1,ray,cluster --before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.processes import descendants, vm_rss

REPO = Path(__file__).resolve().parent.parent
MODES = ("before", "one", "one16", "one1", "ray", "cluster")

if TYPE_CHECKING:
    from tests.ray_cluster import Cluster


def make_corpus(source: Path, passages: int, out: Path) -> Path:
    """`passages` records from `source`, repeated with the copy number appended."""
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    with out.open("w", encoding="utf-8") as f:
        for n in range(passages):
            row = rows[n % len(rows)]
            copy = n // len(rows)
            text = row.get("text") or row.get("contents") or ""
            record = {"id": f"{row.get('id', n)}-{copy}", "text": f"{text} ({copy})"}
            f.write(json.dumps(record) + "\n")
    return out


def run_mode(mode: str, corpus: Path, actors: int, address: str | None) -> dict[str, float]:
    """Index `corpus` in this process (`one`) or with Ray (`ray`, `cluster` at `address`);
    seconds, documents, passages, peak RSS."""
    from selfrag.infra.embeddings.embedder import SentenceEmbedder
    from selfrag.infra.store.qdrant_store import QdrantStore
    from selfrag.jobs.indexing import index_corpus
    from selfrag.jobs.ray_indexing import index_corpus_ray
    from selfrag.schemas.settings import RetrievalSettings

    # Defaults unless `one16`: an older checkout (`before`) may know no format.
    pinned = {"embedding_format": "f16"} if mode == "one16" else {}
    settings = RetrievalSettings(**pinned)
    with tempfile.TemporaryDirectory() as home:
        embedder = SentenceEmbedder(threads=1, **{"fmt": "f16"} if pinned else {})
        embedder.embed(["load"])  # the model's conversion and load are not indexing
        with QdrantStore.open(settings, Path(home), embedder) as store:
            started, cpu = time.perf_counter(), _cpu_seconds()
            if mode in ("one", "one16", "before"):  # `before`: `one` of the checkout on PYTHONPATH
                report = index_corpus(corpus, store, progress=False, retrieval=settings)
            elif mode == "one1":
                report = index_corpus(corpus, store, progress=False, retrieval=settings, threads=1)
            else:
                report = index_corpus_ray(
                    corpus, store, retrieval=settings, actors=actors, address=address,
                    progress=False,
                )  # fmt: skip
            seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "documents": report.documents,
        "passages": report.passages,
        "peak_mb": peak_mb,
    }


def _cpu_seconds() -> float:
    """This process's CPU time, every thread's, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def tree_rss_mb(roots: list[int]) -> float:
    """The summed RSS of `roots` and every process under them, MiB."""
    return sum(vm_rss(pid) or 0 for pid in descendants(*roots)) / 2**20


def run_child(
    mode: str, corpus: Path, actors: int, cluster: Cluster | None, before: Path | None = None
) -> dict[str, float]:
    """Run one mode in a child process, sampling its process tree's memory (and the
    cluster's) until it exits; `before`: a folder holding `selfrag` (the older checkout)."""
    command = [sys.executable, "-m", "bench.indexing", "--mode", mode, "--corpus", str(corpus)]
    command += ["--actors", str(actors)]
    if cluster:
        command += ["--address", cluster.address]
    # llama.cpp's threads wait as `selfrag index` has them wait (model.omp_wait_policy).
    env = {**(cluster.env if cluster else os.environ), "OMP_WAIT_POLICY": "PASSIVE"}
    if before is not None:
        env["PYTHONPATH"] = str(before)
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    roots = [proc.pid, *(p.pid for p in cluster.procs)] if cluster else [proc.pid]
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, tree_rss_mb(roots))
        time.sleep(0.2)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise SystemExit(f"bench.indexing: mode {mode} exited {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1]) | {"all_peak_mb": peak}


def run_on_cluster(corpus: Path, actors: int) -> dict[str, float] | None:
    """The `cluster` mode inside a loopback-only network namespace; None when this process
    may not make one."""
    from tests.netns import LoopbackNamespace, NamespaceUnavailable
    from tests.ray_cluster import running_cluster

    try:
        ns = LoopbackNamespace()
    except NamespaceUnavailable as exc:
        print(f"cluster mode skipped: {exc}", file=sys.stderr)
        return None
    try:
        with ns.entered(), running_cluster() as cluster:
            return run_child("cluster", corpus, actors, cluster)
    finally:
        ns.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=10_000)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--modes", default="one,ray,cluster", help="comma-separated")
    parser.add_argument(
        "--before", type=Path, help="an older checkout of selfrag, for the `before` mode"
    )
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # a child: one mode, its figures as JSON
        print(json.dumps(run_mode(args.mode, args.corpus, args.actors, args.address)))
        return
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}; choose from {MODES}")
    if ("before" in modes) != (args.before is not None):
        parser.error("the `before` mode and --before DIR go together")
    with tempfile.TemporaryDirectory() as tmp:
        before_path = None
        if args.before is not None:  # a folder holding `selfrag`, first on the child's path
            before_path = Path(tmp) / "before"
            before_path.mkdir()
            (before_path / "selfrag").symlink_to(args.before.resolve())
        corpus = make_corpus(
            args.data / "wiki_sample_1000.jsonl", args.passages, Path(tmp) / "corpus.jsonl"
        )
        rows: dict[str, dict[str, float]] = {}
        for mode in modes:
            load = os.getloadavg()[0]
            row = (
                run_on_cluster(corpus, args.actors)
                if mode == "cluster"
                else run_child(
                    mode, corpus, args.actors, None, before_path if mode == "before" else None
                )
            )
            if row is not None:
                rows[mode] = row | {"load": load}
    print(
        f"{'mode':<8} {'passages':>8} {'seconds':>8} {'CPU s':>6} {'docs/s':>7} {'passages/s':>10} "
        f"{'driver MiB':>10} {'all MiB':>8} {'load':>5}"
    )
    for mode, r in rows.items():
        print(
            f"{mode:<8} {r['passages']:>8.0f} {r['seconds']:>8.1f} {r.get('cpu_s', 0):>6.1f} "
            f"{r['documents'] / r['seconds']:>7.1f} {r['passages'] / r['seconds']:>10.1f} "
            f"{r['peak_mb']:>10.0f} {r['all_peak_mb']:>8.0f} {r['load']:>5.1f}"
        )
    base = rows.get("one")
    fields = [f"passages={args.passages}", f"actors={args.actors}"]
    for mode, r in rows.items():
        fields.append(f"{mode}_s={r['seconds']:.1f}")
        fields.append(f"{mode}_cpu_s={r.get('cpu_s', 0):.1f}")
        fields.append(f"{mode}_docs_per_s={r['documents'] / r['seconds']:.1f}")
        fields.append(f"{mode}_all_peak_mb={r['all_peak_mb']:.0f}")
        if base and mode in ("ray", "cluster"):
            fields.append(f"{mode}_speedup={base['seconds'] / r['seconds']:.2f}")
        elif base and mode != "one":  # how much faster `one` indexes than this mode
            fields.append(f"one_over_{mode}={r['seconds'] / base['seconds']:.2f}")
    print(" ".join(fields))


if __name__ == "__main__":
    main()
