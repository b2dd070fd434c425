"""A real two-node Ray cluster on this machine: `ray start --head` and a second `ray start
--address=…` (a second raylet is a second node), each its own process group, stopped by its
own pid (never `ray stop`, which stops every Ray on the machine), with their own temp folder
and ports. The module runs in a network namespace of its own that holds only loopback
(tests/netns.py): Ray binds and reports the machine's address whatever --node-ip-address
says, and there that address is 127.0.0.1, so nothing outside reaches the cluster or is
reached by it. `selfrag batch --address`, `selfrag serve --address`, `serve deploy
deploy/serve.yaml` (through the head's dashboard) and `serve shutdown` run on it in child
processes (the driver is not this test process, as a user's is not). The worker carries the
`selfrag-index` label deploy/serve.yaml pins the Retriever to. The last tests kill the worker's
raylet mid-batch, once with a pool the head alone still holds and once with one it does not,
and start a new worker after each."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.netns import LoopbackNamespace, NamespaceUnavailable
from tests.paths import ROOT
from tests.procfs import process_stat
from tests.ray_cluster import Cluster, ClusterStartError, running_cluster, start_worker
from tests.real import real
from tests.redis_proc import free_port

SERVE = Path(sys.executable).with_name("serve")
# Tiny dials: one segment of 8 tokens, so 12 questions take seconds.
TINY = {"mode": "never", "max_segments": 1, "max_segment_tokens": 8, "critique": "likelihood"}


@pytest.fixture(scope="module")
def loopback() -> Iterator[LoopbackNamespace]:
    """The module's network namespace, holding only loopback: this thread (so every process
    and thread the tests start, and every socket they open) is in it until the module ends."""
    try:
        ns = LoopbackNamespace()
    except NamespaceUnavailable as exc:
        pytest.skip(f"a cluster on loopback only needs a network namespace of its own: {exc}")
    try:
        with ns.entered():
            yield ns
    finally:
        ns.close()


@pytest.fixture(scope="module")
@real
def cluster(loopback: LoopbackNamespace) -> Iterator[Cluster]:
    """A head (1 CPU, with the dashboard) and one worker node (1 CPU) on 127.0.0.1."""
    try:
        with running_cluster() as c:
            yield c
    except ClusterStartError as exc:
        pytest.fail(str(exc))


def _selfrag(
    cluster: Cluster, home: Path, *args: str, timeout_s: float
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = cluster.env | {"SELFRAG_HOME": str(home)}
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "selfrag", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        pytest.fail(
            f"selfrag {' '.join(args)} still running after {timeout_s:.0f} s:\n{err[-3000:]}"
        )
    return done, time.monotonic() - start


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _question_file(
    normans_squad: Path, path: Path, n: int, prefix: str, config: dict[str, Any]
) -> list[str]:
    """Write the first `n` distinct Normans questions to `path` as batch JSONL (ids
    `{prefix}0`…, each with `config`); their ids, sorted."""
    data = json.loads(normans_squad.read_text())
    qs = list(
        dict.fromkeys(qa["question"] for p in data["data"][0]["paragraphs"] for qa in p["qas"])
    )[:n]
    path.write_text(
        "".join(
            json.dumps({"id": f"{prefix}{i}", "question": q, "config": config}) + "\n"
            for i, q in enumerate(qs)
        )
    )
    return sorted(f"{prefix}{i}" for i in range(len(qs)))


@pytest.fixture(scope="module")
def questions(normans_squad: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cluster") / "questions.jsonl"
    _question_file(normans_squad, path, 12, "q", TINY)
    return path


def test_the_cluster_has_two_nodes_on_loopback_only(cluster: Cluster, loopback: LoopbackNamespace):
    assert loopback.interfaces() == ["lo"]  # no interface but loopback: nothing else to bind
    nodes = cluster.state()["exports"]
    assert len(nodes) == 2
    assert {host for _, host, _ in nodes} == {"127.0.0.1"}  # not the machine's address


def _batch(
    cluster: Cluster, home: Path, questions: Path, out: Path, *flags: str, timeout_s: float
) -> tuple[subprocess.CompletedProcess[str], float]:
    return _selfrag(
        cluster, home, "batch", str(questions), "--out", str(out),
        "--address", cluster.address, "--no-progress", *flags, timeout_s=timeout_s,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        # Three actors of a whole CPU: two nodes of one CPU hold two.
        (("--actors", "3", "--actor-cpus", "1"), "asked for 3 engine actors of 1 CPU each"),
        # One actor of 1.5 CPUs: 2 CPUs in all, but an actor runs on one node.
        (("--actor-cpus", "1.5"), "asked for engine actors of 1.5 CPU each"),
    ],
)
def test_a_batch_whose_actors_fit_no_node_says_so_within_seconds(
    cluster: Cluster,
    indexed_home: Path,
    questions: Path,
    tmp_path: Path,
    flags: tuple[str, ...],
    says: str,
):
    out = tmp_path / "a.jsonl"
    done, elapsed = _batch(cluster, indexed_home, questions, out, *flags, timeout_s=120)
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert says in done.stderr, done.stderr[-3000:]
    assert "the cluster has 2 nodes with CPUs free" in done.stderr, done.stderr[-3000:]
    # Python, Ray's import and the connection take most of it; no actor is started.
    assert elapsed < 30, elapsed
    assert not out.exists() or _records(out) == []


def test_batch_on_two_nodes_places_engine_actors_on_both_and_a_rerun_completes(
    cluster: Cluster, indexed_home: Path, questions: Path, tmp_path: Path
):
    out = tmp_path / "a.jsonl"
    before = {a[0] for a in cluster.state()["actors"]}
    # The defaults, as the user ran it: the pool is sized to the nodes.
    done, _ = _batch(cluster, indexed_home, questions, out, timeout_s=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "answered=12 failed=0" in done.stdout
    records = _records(out)
    assert sorted(r["id"] for r in records) == sorted(f"q{i}" for i in range(12))
    assert all(r["status"] == "ok" and r["response"]["answer"] for r in records), records
    seen = cluster.state()
    new = [a for a in seen["actors"] if a[0] not in before]
    engines = {node for _, cls, node in new if "BatchAnswerer" in cls}
    retrievers = [node for _, cls, node in new if cls == "PassageService"]
    assert engines == set(seen["nodes"]), new  # one engine actor per node
    # The embedded store is the driver's folder: its one owner runs on the driver's node
    # (the head's here: the driver joins through the head's raylet).
    assert retrievers == [seen["head"]], new

    # A run killed after five records, one torn line: the same command completes it.
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])
    done, _ = _batch(cluster, indexed_home, questions, out, timeout_s=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "answered=7 failed=0 skipped=5" in done.stdout
    ids = [r["id"] for r in _records_skipping_torn(out)]
    assert sorted(ids) == sorted(f"q{i}" for i in range(12))  # one record per id


def test_index_on_two_nodes_embeds_on_both_and_answers_from_it(
    cluster: Cluster, normans_squad: Path, tmp_path: Path
):
    """`selfrag index --ray --address` spreads the embedding actors over the nodes (one CPU
    each: one per node here) and the index answers."""
    home = tmp_path / "home"
    before = {a[0] for a in cluster.state()["actors"]}
    done, _ = _selfrag(
        cluster, home, "index", "--ray", "--address", cluster.address, "--actors", "2",
        "--no-progress", "--no-calibrate", str(normans_squad), timeout_s=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "passages indexed" in done.stdout, done.stdout
    seen = cluster.state()
    embedders = {node for aid, cls, node in seen["actors"] if aid not in before and "Map" in cls}
    assert embedders == set(seen["nodes"]), seen["actors"]
    asked, _ = _selfrag(
        cluster, home, "ask", "Who was the Norse leader who founded Normandy?", "--json",
        "--mode", "always", "--top-k", "2", "--max-segments", "1", timeout_s=300,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr[-3000:]
    passages = json.loads(asked.stdout)["passages"]
    assert passages and all(p["id"].startswith("squad:Normans:") for p in passages)


def _records_skipping_torn(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def test_serve_joins_the_cluster_spreads_replicas_over_both_nodes_and_answers(
    cluster: Cluster, indexed_home: Path, tmp_path: Path
):
    """`selfrag serve --address` deploys onto the running cluster (no private Ray): the app's
    deployments (1.6 CPUs in all) do not fit the head's one CPU, so replicas land on both
    nodes, and an answer comes back through the head's HTTP proxy. The worker's proxy cannot
    bind the same port on this one machine (on a real cluster each node has its own). The
    embedded store's Retriever runs on the command's own node, the head's here (the driver
    joins through the head's raylet), whatever the worker's label says."""
    import httpx

    before = {a[0] for a in cluster.state()["actors"]}
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    env = cluster.env | {"SELFRAG_HOME": str(indexed_home)}
    serve_cmd = [sys.executable, "-m", "selfrag", "serve", "--address", cluster.address]
    proc = subprocess.Popen(
        [*serve_cmd, "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 150
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            while True:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                try:
                    if client.get("/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(2)
            config = {**TINY, "mode": "always", "top_k": 2}
            r = client.post(
                "/v1/answer", json={"question": "Who were the Normans?", "config": config}
            )
            assert r.status_code == 200, r.text
            assert r.json()["answer"] and r.json()["passages"]
        seen = cluster.state()
        new = [a for a in seen["actors"] if a[0] not in before]
        replicas = {node for _, cls, node in new if cls.startswith("ServeReplica:selfrag:")}
        assert replicas == set(seen["nodes"]), new
        retrievers = [node for _, cls, node in new if cls == "ServeReplica:selfrag:Retriever"]
        assert retrievers == [seen["head"]], new
    finally:
        # SIGTERM: the command deletes its app (this cluster's Serve stays) and exits.
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        log.close()
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
    # The app is gone; the cluster (and its other jobs) stay.
    assert _selfrag_replicas(cluster) == []


WATCH = """
import json, time, ray
from ray import serve
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
ray.init(address={address!r}, log_to_driver=False)
controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
print(json.dumps({{"port": ray.get(controller.get_http_config.remote(), timeout=30).port}}),
      flush=True)
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    app = serve.status().applications.get("selfrag")
    if app is not None:
        running = {{name: sum(n for s, n in d.replica_states.items() if str(getattr(s, "value", s))
                             == "RUNNING") for name, d in app.deployments.items()}}
        pool = app.deployments.get("BranchPool")
        print(json.dumps({{"t": time.monotonic(), "status": str(getattr(app.status, "value",
                          app.status)), "running": running,
                          "pool": pool and {{str(getattr(s, "value", s)): n
                                             for s, n in pool.replica_states.items()}},
                          "pool_message": pool and pool.message}}), flush=True)
    time.sleep(0.5)
"""

# Written by the head's dashboard into its temp folder (docs/cluster.md, "Scrape metrics").
DISCOVERY = "prom_metrics_service_discovery.json"
# One from the ingress replica, one from the engine replicas (README, "Metrics and logs").
SCRAPED = ("ray_selfrag_http_requests_total", "ray_selfrag_batch_requests")


def _scrape_every_node(cluster: Cluster, timeout_s: float) -> dict[str, str]:
    """Each alive node's metrics export (`--metrics-export-port`), as Prometheus scrapes it,
    once selfrag's series from both kinds of replica are in (Ray exports every few seconds)."""
    import httpx

    targets = cluster.state()["exports"]
    deadline = time.monotonic() + timeout_s
    while True:
        texts = {
            node: httpx.get(f"http://{host}:{port}/metrics", timeout=10).text
            for node, host, port in targets
        }
        if all(any(name in t for t in texts.values()) for name in SCRAPED):
            return texts
        assert time.monotonic() < deadline, {n: len(t) for n, t in texts.items()}
        time.sleep(2)


def _selfrag_replicas(cluster: Cluster) -> list[str]:
    """The classes of the selfrag app's alive Serve replicas."""
    return [a for a in cluster.state()["alive"] if a.startswith("ServeReplica:selfrag:")]


def _serve_cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """`serve ARGS --address DASHBOARD`: the Serve CLI's REST commands, through the head's
    dashboard, as a user runs them."""
    done = subprocess.run(
        [str(SERVE), *args, "--address", cluster.dashboard],
        cwd=ROOT,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def _wait_until_no_replica_of_selfrag(cluster: Cluster, timeout_s: float) -> None:
    """`serve shutdown` deletes the applications asynchronously: wait for their replicas."""
    deadline = time.monotonic() + timeout_s
    while alive := _selfrag_replicas(cluster):
        assert time.monotonic() < deadline, alive
        time.sleep(1)


class _Watcher:
    """A child driver that prints the selfrag app's RUNNING replicas per deployment twice a
    second (one connection for the whole test, not one per look)."""

    def __init__(self, cluster: Cluster, out: Path, seconds: float) -> None:
        self.out = out
        code = WATCH.format(address=cluster.address, seconds=seconds)
        with out.open("wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                env=cluster.env,
                stdout=f,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.out.read_text().splitlines() if x.startswith("{")]

    def wait_for(
        self,
        what: str,
        test: Callable[[dict[str, Any]], bool],
        timeout_s: float,
        context: Callable[[], str] = str,
    ) -> dict[str, Any]:
        """The first line that passes `test`; fails after `timeout_s`, with `context()`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the watcher stopped: {self.lines()[-3:]}"
            seen = [x for x in self.lines() if "running" in x and test(x)]
            if seen:
                return seen[0]
            time.sleep(0.5)
        pytest.fail(
            f"not seen in {timeout_s:.0f} s: {what}; last: {self.lines()[-3:]}; {context()}"
        )

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def test_the_branch_pool_autoscales_to_two_replicas_under_load_and_back_to_one(
    cluster: Cluster, indexed_home: Path, tmp_path: Path
):
    """deploy/serve.yaml, deployed with `serve deploy` through the head's dashboard, with the
    BranchPool's CPUs halved (so that two replicas fit these 1-CPU nodes) and its autoscaling
    shortened for a test: target 1 ongoing call, at most 2 replicas, 1 s to scale up, 2 s to
    scale down, 3 s of look-back, metrics every second (production: target 24, max 8, 30 s
    and 300 s; serve.yaml says why). Four clients asking distinct
    questions keep ~4 calls at the pool: it goes to 2 replicas, and back to 1 once they stop.
    The Retriever lands on the node labelled `selfrag-index=true` (the worker), as the file
    pins it. Both nodes' metrics exports answer a scrape, selfrag's series among them, and
    the head lists both in its Prometheus discovery file. `serve shutdown` removes the app."""
    import httpx

    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": free_port()}
    app = config["applications"][0]
    app["runtime_env"] = {
        "env_vars": {"SELFRAG_HOME": str(indexed_home), "SELFRAG_MODEL__N_THREADS": "1"}
    }
    pool = next(d for d in app["deployments"] if d["name"] == "BranchPool")
    pool["autoscaling_config"] |= {
        "max_replicas": 2,
        "target_ongoing_requests": 1,
        "upscale_delay_s": 1,
        "downscale_delay_s": 2,
        "look_back_period_s": 3,
        "metrics_interval_s": 1,
    }
    # A replica's CPUs must be free on one node. The app's first replicas leave 0.8 of these
    # two nodes' 2 CPUs, and Serve may split them 0.4 and 0.4, where a second 0.5-CPU pool
    # replica fits no node and waits (seen: "taken more than 30s to be scheduled"). At 0.25,
    # one node always has room. docs/cluster.md, "Limits", says so for users.
    pool["ray_actor_options"]["num_cpus"] = 0.25
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    before = {a[0] for a in cluster.state()["actors"]}
    deployed = _serve_cli(cluster, "deploy", str(path))
    assert "Sent deploy request successfully" in deployed.stdout + deployed.stderr
    watcher = _Watcher(cluster, tmp_path / "replicas.jsonl", seconds=400)
    stop = threading.Event()
    statuses: list[int | str] = []
    try:
        watcher.wait_for("the app RUNNING", lambda x: x["status"] == "RUNNING", 150)
        # Serve's proxies keep the port of the first app on this cluster (an earlier test's).
        port = watcher.lines()[0]["port"]
        counter = iter(range(10**6))
        config_tiny = {**TINY, "mode": "always", "top_k": 2}

        def client() -> None:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
                while not stop.is_set():
                    # Distinct questions: a repeat would be a query-cache hit, no pool call.
                    q = f"Who were the Normans? ({next(counter)})"
                    try:
                        r = http.post("/v1/answer", json={"question": q, "config": config_tiny})
                    except httpx.HTTPError as exc:  # said in the failure, not lost in a thread
                        statuses.append(repr(exc))
                        time.sleep(1)
                        continue
                    statuses.append(r.status_code)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        started = time.monotonic()
        for t in threads:
            t.start()
        up = watcher.wait_for(
            "BranchPool at 2 replicas",
            lambda x: x["running"].get("BranchPool", 0) >= 2,
            90,
            context=lambda: f"answers so far: {collections.Counter(statuses)}",
        )
        stop.set()
        for t in threads:
            t.join(timeout=120)
        stopped = time.monotonic()
        down = watcher.wait_for(
            "BranchPool back at 1 replica",
            lambda x: x["t"] > stopped and x["running"].get("BranchPool", 0) == 1,
            90,
        )
        seen = cluster.state()
        # The scrape docs/cluster.md describes: every node's export, selfrag's series in them.
        exports = _scrape_every_node(cluster, timeout_s=60)
    finally:
        stop.set()
        watcher.stop()
        _serve_cli(cluster, "shutdown", "--yes")
    _wait_until_no_replica_of_selfrag(cluster, timeout_s=90)
    assert statuses and set(statuses) == {200}, statuses
    counts = [x["running"].get("BranchPool", 0) for x in watcher.lines() if "running" in x]
    assert max(counts) == 2 and counts[-1] == 1, counts  # never past max_replicas
    print(
        f"pool 1 -> 2 replicas {up['t'] - started:.1f} s after the load started, 2 -> 1 "
        f"{down['t'] - stopped:.1f} s after it stopped ({len(statuses)} answers)"
    )
    assert down["t"] - started < 120
    new = [a for a in seen["actors"] if a[0] not in before]
    replicas = {node for _, cls, node in new if cls.startswith("ServeReplica:selfrag:")}
    assert replicas == set(seen["nodes"]), new  # the deployed app runs on both nodes
    retrievers = [node for _, cls, node in new if cls == "ServeReplica:selfrag:Retriever"]
    worker = next(n for n in seen["nodes"] if n != seen["head"])
    assert retrievers == [worker], new
    assert set(exports) == set(seen["nodes"])  # both nodes answer the scrape
    assert all("\nray_" in text for text in exports.values())
    # The head's dashboard lists the alive nodes' exports for Prometheus's file discovery
    # (beside its own and the autoscaler's metrics ports).
    discovery = json.loads((cluster.temp_dir / DISCOVERY).read_text())
    listed = {target for group in discovery for target in group["targets"]}
    exported = {f"{host}:{port}" for _, host, port in cluster.state()["exports"]}
    assert exported <= listed, (exported, listed)


def _raylet_of(proc: subprocess.Popen[bytes]) -> int:
    """The pid of the raylet in `proc`'s process group (a node's `ray start --block`)."""
    for entry in Path("/proc").glob("[0-9]*"):
        stat = process_stat(entry.name)
        if stat is not None and stat[0] == "raylet" and int(stat[1][2]) == proc.pid:
            return int(entry.name)
    raise AssertionError(f"no raylet in process group {proc.pid}")


def _questions_for_kill(normans_squad: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    """16 distinct Normans questions of one 16-token segment each, and their ids."""
    src = tmp_path / "questions.jsonl"
    config = {**TINY, "max_segment_tokens": 16}
    return src, _question_file(normans_squad, src, 16, "k", config)


@dataclass
class _Killed:
    """What a batch did when the worker's raylet was SIGKILLed under it."""

    command: list[str]
    rc: int
    took_s: float  # from the kill to the command's exit
    stderr: str
    worker: str  # the killed node's id
    restarted_engines: int  # this run's engine actors that Ray restarted after the kill


def _kill_worker_mid_batch(
    cluster: Cluster, home: Path, src: Path, out: Path, *flags: str
) -> _Killed:
    """Run `selfrag batch --address` on `src`; once two records are written, hold the batch
    (SIGSTOP), SIGKILL the worker node's raylet, wait until the cluster has declared the node
    dead, and let the batch go on (SIGCONT): its next node check sees the node gone, whatever
    the machine's load (unheld, a loaded machine let the run finish before the kill took
    effect). Then wait for the command to end; the rest of the node's processes go too, and
    the cluster is left with the head alone."""
    env = cluster.env | {"SELFRAG_HOME": str(home)}
    command = [
        sys.executable, "-m", "selfrag", "batch", str(src), "--out", str(out),
        "--address", cluster.address, "--no-progress", "--per-actor", "2", *flags,
    ]  # fmt: skip
    assert cluster.worker is not None
    dead = cluster.worker
    seen = cluster.state()
    before = {a[0] for a in seen["actors"]}
    worker = next(n for n in seen["nodes"] if n != seen["head"])
    err = out.with_suffix(".err")
    with out.with_suffix(".out").open("wb") as so, err.open("wb") as se:
        run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=so, stderr=se)
    try:
        deadline = time.monotonic() + 180
        while not (out.exists() and len(_records_skipping_torn(out)) >= 2):
            assert run.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "no records after 180 s"
            time.sleep(0.2)
        os.kill(run.pid, signal.SIGSTOP)
        try:
            os.kill(_raylet_of(dead), signal.SIGKILL)
            killed = time.monotonic()
            while worker in cluster.state()["nodes"]:  # ~5 s of missed health checks (HEAD_ENV)
                assert time.monotonic() - killed < 120, "the killed node still counts as alive"
                time.sleep(0.5)
        finally:
            os.kill(run.pid, signal.SIGCONT)
        rc = run.wait(timeout=180)
        took = time.monotonic() - killed
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        os.killpg(dead.pid, signal.SIGKILL)  # the rest of the dead node's processes
    after = cluster.state()
    engines = {i for i, cls, _ in after["actors"] if "BatchAnswerer" in cls and i not in before}
    restarted = len(engines & set(after["restarted"]))
    return _Killed(command, rc, took, err.read_text(), worker, restarted)


def test_a_worker_raylet_killed_mid_batch_whose_pool_fits_the_head_finishes_there(
    cluster: Cluster, indexed_home: Path, normans_squad: Path, tmp_path: Path
):
    """Two engine actors of 0.4 CPU, one on each node (Ray Data spreads them). SIGKILL the
    worker's raylet: once Ray declares the node dead (~5 s here), the head's one CPU still holds
    both actors and the retriever, so the driver leaves the lost actor to Ray Data, which
    restarts it on the head and retries its batches; the run finishes there with exit 0 and
    one record per id. A new worker joins afterwards."""
    src, ids = _questions_for_kill(normans_squad, tmp_path)
    out = tmp_path / "a.jsonl"
    killed = _kill_worker_mid_batch(
        cluster, indexed_home, src, out, "--actors", "2", "--actor-cpus", "0.4"
    )
    print(f"run finished {killed.took_s:.1f} s after the kill, exit {killed.rc}")
    assert killed.restarted_engines == 1, killed  # the worker's engine actor, on the head
    assert killed.rc == 0, killed.stderr[-3000:]
    said = f"node {killed.worker[:8]} left the cluster; its engine actors restart on the others"
    assert said in killed.stderr, killed.stderr[-3000:]
    records = _records(out)
    assert sorted(r["id"] for r in records) == ids  # one record per id, none lost
    assert all(r["status"] == "ok" for r in records), records

    start_worker(cluster, nodes=2)


def test_a_worker_raylet_killed_mid_batch_stops_the_run_cleanly_and_the_rerun_completes(
    cluster: Cluster, indexed_home: Path, normans_squad: Path, tmp_path: Path
):
    """SIGKILL the worker node's raylet while `selfrag batch --address` runs one engine actor
    of 0.9 CPU on each node (the default pool): Ray declares the node dead after its missed
    health checks (~5 s here), and the lost actor cannot restart (the head's one CPU holds the
    other actor and the retriever), so the run stops with exit status 2 and a message naming
    the node, instead of waiting for ever; the records it wrote stay. The same command, on the
    head alone, answers the rest: one record per id. (The module's last test: no new worker.)"""
    src, ids = _questions_for_kill(normans_squad, tmp_path)
    out = tmp_path / "a.jsonl"
    killed = _kill_worker_mid_batch(cluster, indexed_home, src, out)
    written = _records_skipping_torn(out)
    print(
        f"run stopped {killed.took_s:.1f} s after the kill, exit {killed.rc}, "
        f"{len(written)} of {len(ids)} records"
    )
    err = killed.stderr
    assert killed.rc == 2, err[-3000:]
    assert f"node {killed.worker[:8]} left the cluster mid-run" in err, err[-3000:]
    assert "run the same command again" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # the message, not the abandoned Dataset's noise
    assert 2 <= len(written) < len(ids)
    assert all(r["status"] == "ok" for r in written), written

    done, _ = _selfrag(cluster, indexed_home, *killed.command[3:], timeout_s=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"skipped={len(written)}" in done.stdout, done.stdout
    records = _records(out)  # no torn line: the stopped run wrote whole lines only
    assert sorted(r["id"] for r in records) == ids  # exactly one record per id
    assert all(r["status"] == "ok" for r in records)
