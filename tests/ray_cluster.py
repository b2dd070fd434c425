"""A real two-node Ray cluster on this machine, for the cluster tests and `bench.indexing`: `ray
start --head` and a second `ray start --address=…` (a second raylet is a second node), each its
own process group, stopped by its own pid (never `ray stop`, which stops every Ray on the
machine), with their own temp folder and ports. Start it inside a `tests.netns`
`LoopbackNamespace`: Ray binds and reports the machine's address whatever `--node-ip-address`
says, and there that address is 127.0.0.1. The worker carries the `selfrag-index` label
deploy/serve.yaml pins the Retriever to."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster_probe import PREFIX
from tests.paths import ROOT
from tests.redis_proc import free_port

RAY = Path(sys.executable).with_name("ray")
# The head's GCS checks each node every second instead of every 3 s (5 misses declare it dead),
# so a test that kills a node waits about 5 s for Ray to say so, not 15.
HEAD_ENV = {"RAY_health_check_period_ms": "1000"}


class ClusterStartError(RuntimeError):
    """A node did not come up or join in time; the message ends with its log's tail."""


class ClusterProbe:
    """`python -m tests.cluster_probe`, one driver of the cluster for its whole life: `state()`
    asks it for the cluster's state (`tests.cluster_probe.cluster_state`)."""

    def __init__(self, address: str, env: dict[str, str], log: Path, timeout_s: float = 60):
        self.log = log  # its stderr
        self.timeout_s = timeout_s
        with log.open("wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.cluster_probe", address],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._answer()  # connected

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(PREFIX):
                self._lines.put(line.removeprefix(PREFIX))
        self._lines.put(None)  # it ended

    def _answer(self) -> Any:
        try:
            line = self._lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"the cluster probe gave no answer in {self.timeout_s:.0f} s: {self._tail()}"
            ) from None
        if line is None:
            raise AssertionError(f"the cluster probe ended: {self._tail()}")
        return json.loads(line)

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def state(self) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write("state\n")
        self._proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()


@dataclass
class Cluster:
    address: str
    dashboard: str  # the head's dashboard, for `serve deploy` / `serve shutdown`
    temp_dir: Path
    env: dict[str, str]
    # Every node's `ray start --block` (its process group), the head first; `running_cluster`
    # stops them all. `worker` is the live worker's.
    procs: list[subprocess.Popen[bytes]]
    worker: subprocess.Popen[bytes] | None = None
    # Once the head is up: one driver that answers what the cluster holds.
    probe: ClusterProbe | None = None

    def state(self) -> dict[str, Any]:
        """The cluster's alive nodes, head and actors, as `tests.cluster_probe` gives them."""
        assert self.probe is not None, "the cluster's head is not up yet"
        return self.probe.state()


def ray_env() -> dict[str, str]:
    """This environment without RAY_* settings, with no auth token on loopback, no usage
    stats (they would try the network) and the repository on the path, before what the path
    already holds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env |= {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": path}
    return env


def node_ports() -> list[str]:
    """Ports of one raylet's agents: two nodes on one machine would collide on the defaults."""
    return [
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
    ]


def stop_node(proc: subprocess.Popen[bytes]) -> None:
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


def alive_nodes(address: str, env: dict[str, str]) -> int:
    """How many nodes of the cluster at `address` are alive (0 when it cannot be reached)."""
    code = (
        "import ray\n"
        f"ray.init(address={address!r}, log_to_driver=False)\n"
        "print(sum(1 for n in ray.nodes() if n['Alive']))\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return 0
    try:
        return int(done.stdout.split()[-1])
    except (IndexError, ValueError):
        return 0


def _alive(cluster: Cluster) -> int:
    if cluster.probe is None:
        return alive_nodes(cluster.address, cluster.env)
    return len(cluster.state()["nodes"])


def _wait_for_nodes(cluster: Cluster, proc: subprocess.Popen[bytes], nodes: int, log: Path,
                    timeout_s: float) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while _alive(cluster) < nodes:
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:]
            raise ClusterStartError(f"{log.stem} did not come up in {timeout_s:.0f} s:\n{tail}")
        time.sleep(1)


def start_worker(cluster: Cluster, nodes: int, timeout_s: float = 90) -> None:
    """Start a worker node (its own process group, one CPU, labelled `selfrag-index=true`) and
    wait until the cluster has `nodes` alive nodes."""
    log = cluster.temp_dir / f"worker{len(cluster.procs)}.log"
    worker = [
        str(RAY), "start", f"--address={cluster.address}", "--block", "--num-cpus=1",
        "--node-ip-address=127.0.0.1", "--disable-usage-stats", "--labels=selfrag-index=true",
        *node_ports(),
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            worker, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    cluster.procs.append(proc)
    cluster.worker = proc
    _wait_for_nodes(cluster, proc, nodes, log, timeout_s)


@contextmanager
def running_cluster(timeout_s: float = 90) -> Iterator[Cluster]:
    """A head (1 CPU, with the dashboard) and one worker node (1 CPU) on 127.0.0.1, stopped
    and their temp folder removed when the block ends."""
    # Short: Ray's socket paths under it must fit the 107 bytes of a Unix socket name.
    temp_dir = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
    port, dashboard_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    cluster = Cluster(address, f"http://127.0.0.1:{dashboard_port}", temp_dir, ray_env(), [])
    try:
        head = [
            str(RAY), "start", "--head", "--block", "--num-cpus=1",
            f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=true",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
            f"--ray-client-server-port={free_port()}", f"--temp-dir={temp_dir}",
            "--disable-usage-stats", *node_ports(),
        ]  # fmt: skip
        log = temp_dir / "head.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                head, env=cluster.env | HEAD_ENV, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        cluster.procs.append(proc)
        _wait_for_nodes(cluster, proc, 1, log, timeout_s)
        cluster.probe = ClusterProbe(cluster.address, cluster.env, temp_dir / "probe.log")
        start_worker(cluster, nodes=2, timeout_s=timeout_s)
        yield cluster
    finally:
        if cluster.probe is not None:
            cluster.probe.close()
        for proc in reversed(cluster.procs):
            stop_node(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)
