"""A real two-node Ray cluster on this machine: `ray start --head` and a second `ray start
--address=…` (a second raylet is a second node), each its own process group, stopped by its
own pid (never `ray stop`, which stops every Ray on the machine), on loopback, with their own
temp folder and ports. `selfrag batch --address` runs on it in child processes (the driver is
not this test process, as a user's is not)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.redis_proc import free_port

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")
pytestmark = pytest.mark.real

# Tiny dials: one segment of 8 tokens, so 12 questions take seconds.
TINY = {"mode": "never", "max_segments": 1, "max_segment_tokens": 8, "critique": "likelihood"}


@dataclass
class Cluster:
    address: str
    temp_dir: Path
    env: dict[str, str]


def _ray_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # No auth token on loopback; usage stats would try the network.
    env |= {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    return env


def _node_ports() -> list[str]:
    """Ports of one raylet's agents: two nodes on one machine would collide on the defaults."""
    return [
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
    ]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the node's process group (its raylet, GCS, workers), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            # The group may outlive its leader by a moment: one more SIGKILL round.
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive_nodes(address: str, env: dict[str, str]) -> int:
    code = (
        "import ray\n"
        f"ray.init(address={address!r}, log_to_driver=False)\n"
        "print(sum(1 for n in ray.nodes() if n['Alive']))\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return 0
    try:
        return int(done.stdout.split()[-1])
    except (IndexError, ValueError):
        return 0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head (1 CPU) and one worker node (1 CPU) on 127.0.0.1."""
    # Short: Ray's socket paths under it must fit the 107 bytes of a Unix socket name.
    temp_dir = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
    env = _ray_env()
    port = free_port()
    address = f"127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    logs = [(temp_dir / "head.log").open("wb"), (temp_dir / "worker.log").open("wb")]
    try:
        head = [
            str(RAY), "start", "--head", "--block", "--num-cpus=1",
            f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}", f"--temp-dir={temp_dir}",
            "--disable-usage-stats", *_node_ports(),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                head, env=env, stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        worker = [
            str(RAY), "start", f"--address={address}", "--block", "--num-cpus=1",
            "--node-ip-address=127.0.0.1", "--disable-usage-stats", *_node_ports(),
        ]  # fmt: skip
        deadline = time.monotonic() + 90
        joined = False
        while time.monotonic() < deadline:
            if procs[0].poll() is not None:
                break
            if not joined and _alive_nodes(address, env) >= 1:
                procs.append(
                    subprocess.Popen(
                        worker,
                        env=env,
                        stdout=logs[1],
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
                joined = True
            if joined and _alive_nodes(address, env) == 2:
                break
            time.sleep(1)
        else:
            pass
        if _alive_nodes(address, env) != 2:
            for f in logs:
                f.flush()
            tail = "".join(
                (temp_dir / n).read_text(errors="replace")[-2000:]
                for n in ("head.log", "worker.log")
            )
            pytest.fail(f"the two-node cluster did not come up in 90 s:\n{tail}")
        yield Cluster(address, temp_dir, env)
    finally:
        for proc in reversed(procs):
            _stop(proc)
        for f in logs:
            f.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


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


@pytest.fixture(scope="module")
def questions(normans_squad: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = json.loads(normans_squad.read_text())
    qs = list(
        dict.fromkeys(qa["question"] for p in data["data"][0]["paragraphs"] for qa in p["qas"])
    )
    path = tmp_path_factory.mktemp("cluster") / "questions.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": q, "config": TINY}) + "\n"
            for i, q in enumerate(qs[:12])
        )
    )
    return path


def test_the_cluster_has_two_nodes(cluster: Cluster):
    assert _alive_nodes(cluster.address, cluster.env) == 2


ACTORS = """
import json, ray
from ray._private import state
ray.init(address={address!r}, log_to_driver=False)
head = [n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"]]
actors = [(i, a["ActorClassName"], a["Address"]["NodeID"]) for i, a in state.actors().items()]
print(json.dumps({{"head": head[0], "nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]],
                   "actors": actors}}))
"""


def _actors(cluster: Cluster) -> dict[str, Any]:
    """The cluster's nodes, its head, and every actor it ran (GCS keeps the dead ones): id,
    class, node."""
    done = subprocess.run(
        [sys.executable, "-c", ACTORS.format(address=cluster.address)],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


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
    before = {a[0] for a in _actors(cluster)["actors"]}
    # The defaults, as the user ran it: the pool is sized to the nodes.
    done, _ = _batch(cluster, indexed_home, questions, out, timeout_s=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "answered=12 failed=0" in done.stdout
    records = _records(out)
    assert sorted(r["id"] for r in records) == sorted(f"q{i}" for i in range(12))
    assert all(r["status"] == "ok" and r["response"]["answer"] for r in records), records
    seen = _actors(cluster)
    new = [a for a in seen["actors"] if a[0] not in before]
    engines = {node for _, cls, node in new if "BatchAnswerer" in cls}
    retrievers = [node for _, cls, node in new if cls == "RetrieverActor"]
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
    bind the same port on this one machine (on a real cluster each node has its own)."""
    import httpx

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
        seen = _actors(cluster)
        replicas = {
            node for _, cls, node in seen["actors"] if cls.startswith("ServeReplica:selfrag:")
        }
        assert replicas == set(seen["nodes"]), seen["actors"]
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
    alive = [a for a in _actors_alive(cluster) if a.startswith("ServeReplica:selfrag:")]
    assert alive == []  # the app is gone; the cluster (and its other jobs) stay


def _actors_alive(cluster: Cluster) -> list[str]:
    code = (
        "import ray\nfrom ray._private import state\n"
        f"ray.init(address={cluster.address!r}, log_to_driver=False)\n"
        "print('\\n'.join(a['ActorClassName'] for a in state.actors().values()"
        " if a['State'] == 'ALIVE'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=cluster.env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()
