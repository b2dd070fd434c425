"""Starting or joining Ray (`selfrag.runtime.ray_cluster.init_ray`, used by `selfrag serve` and
`selfrag batch`): each case in a child Python process with its own Ray temp folder (`RAY_TMPDIR`),
so the machine's /tmp/ray and any Ray this test session runs are left alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.paths import ROOT
from tests.real import real
from tests.redis_proc import free_port


def _stale_record(ray_tmp: Path) -> str:
    """What an uncleanly stopped `ray start` leaves: the address of a cluster that is gone."""
    dead = f"127.0.0.1:{free_port()}"
    (ray_tmp / "ray").mkdir(exist_ok=True)
    (ray_tmp / "ray" / "ray_current_cluster").write_text(dead)
    return dead


def _run(
    ray_tmp: Path, code: str, timeout_s: float, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": str(ROOT), **(extra_env or {})}
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"still waiting for Ray after {timeout_s:.0f} s")
    return done, time.monotonic() - start


CONNECT = """
import sys
from selfrag.runtime.ray_cluster import RayUnavailable, init_ray
try:
    init_ray(sys.argv[1] if len(sys.argv) > 1 else {address!r}, log_to_driver=False)
except RayUnavailable as exc:
    print(exc)
    sys.exit(3)
print("connected")
"""


def test_without_an_address_a_private_instance_starts_despite_a_dead_recorded_cluster(
    ray_tmp: Path,
):
    """`ray.init(address=None)` would join the recorded, dead cluster and retry it for
    minutes; a private instance starts instead, and this call owns it."""
    _stale_record(ray_tmp)
    code = (
        "import ray\n"
        "from selfrag.runtime.ray_cluster import init_ray\n"
        "started = init_ray(None, log_to_driver=False)\n"
        "print(started, ray.get(ray.put(41)) + 1, len(ray.nodes()))\n"
        "ray.shutdown()\n"
    )
    done, _ = _run(ray_tmp, code, 120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "42", "1"]


def test_an_address_where_nothing_answers_fails_within_seconds_naming_it(ray_tmp: Path):
    address = f"127.0.0.1:{free_port()}"
    done, elapsed = _run(ray_tmp, CONNECT.format(address=address), 60)
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    assert f"no Ray cluster answers at {address}" in done.stdout
    assert "leave out --address" in done.stdout
    # The child's own Python and Ray import take most of this; the check itself ~ms.
    assert elapsed < 15, elapsed


def test_auto_with_a_dead_recorded_cluster_fails_fast_naming_it(ray_tmp: Path):
    dead = _stale_record(ray_tmp)
    done, elapsed = _run(ray_tmp, CONNECT.format(address="auto"), 60)
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    # Ray resolves a loopback address to this machine's IP; the port is the dead cluster's.
    port = dead.rpartition(":")[2]
    assert f":{port} (where --address auto points" in done.stdout
    assert elapsed < 15, elapsed


def test_a_malformed_address_is_a_clear_error(ray_tmp: Path):
    done, _ = _run(ray_tmp, CONNECT.format(address="not-an-address"), 60)
    assert done.returncode == 3
    assert "'not-an-address' is not host:port, ray://host:port or auto" in done.stdout


PRIVATE = """
import json, os, time, urllib.error, urllib.request
from pathlib import Path
import ray
from selfrag.runtime import ray_cluster
from tests.runtime.test_ray_cluster import listening_sockets

assert ray_cluster.init_ray(None, log_to_driver=False)

@ray.remote
def one():
    return 1

@ray.remote
def periods():
    return {name: os.environ.get(name) for name in ray_cluster.SERVE_PERIODS}

assert ray.get(one.remote()) == 1
worker_periods = ray.get(periods.remote())
time.sleep(3)  # the agents are up by now
def comms(pids):
    return sorted({Path(f"/proc/{p}/comm").read_text().strip() for p in pids})

pids = ray_cluster.private_ray_processes()
names = comms(pids)
# A process title can overwrite the environment block that holds the mark: found without it.
mark = os.environ.pop(ray_cluster.OWNER_ENV)
unmarked = comms(ray_cluster.private_ray_processes())
os.environ[ray_cluster.OWNER_ENV] = mark
sockets = listening_sockets(pids)
refused = {}
for _, _, host, port in sockets:
    at = "127.0.0.1" if host in ("0.0.0.0", "::") or host.endswith("127.0.0.1") else host
    request = urllib.request.Request(
        f"http://{at}:{port}/api/job_agent/jobs/",
        data=json.dumps({"entrypoint": "true"}).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            refused[port] = r.status
    except urllib.error.HTTPError as exc:
        refused[port] = exc.code
    except Exception as exc:  # not HTTP (a gRPC port): no job goes in there either
        refused[port] = type(exc).__name__
session = str(ray._private.worker._global_node.get_session_dir_path())
in_my_group = [n for p, n in zip(pids, map(lambda p: comms([p])[0], pids))
               if os.getpgid(p) == os.getpgrp()]
ray_cluster.shutdown_private_ray()
print(json.dumps({
    "sockets": sockets, "jobs": refused, "session": session, "names": names, "unmarked": unmarked,
    "in_my_group": in_my_group, "periods": worker_periods,
}))
"""


def listening_sockets(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, comm, address, port) of each TCP socket the processes `pids` listen on, from
    /proc (as `ss -ltnp` shows them)."""
    import ipaddress
    import socket
    import struct

    by_inode: dict[str, tuple[str, int]] = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            raw, port = fields[1].split(":")
            words = bytes.fromhex(raw)
            # /proc prints the address as 32-bit words in host (little-endian) order.
            packed = b"".join(
                struct.pack("<I", struct.unpack(">I", words[i : i + 4])[0])
                for i in range(0, len(words), 4)
            )
            address = ipaddress.ip_address(socket.inet_ntop(family, packed))
            by_inode[f"socket:[{fields[9]}]"] = (str(address), int(port, 16))
    found = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target in by_inode:
                    found.append((pid, comm, *by_inode[target]))
        except OSError:
            continue
    return found


def _is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _holding_files_in(folder: str) -> list[str]:
    """`pid comm` of each process with a file open under `folder`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd).startswith(folder + "/") for fd in (entry / "fd").iterdir()):
                found.append(f"{entry.name} {(entry / 'comm').read_text().strip()}")
        except OSError:
            continue
    return found


# A Serve period the operator set: the private instance keeps it.
OPERATORS_PERIOD = "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"


@pytest.fixture(scope="module")
@real
def private_run() -> Iterator[dict]:
    """One private instance: started, its sockets and a job submission tried, stopped."""
    import json

    folder = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    try:
        done, _ = _run(folder, PRIVATE, 180, {OPERATORS_PERIOD: "250"})
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["left"] = _holding_files_in(result["session"])
        yield result
    finally:
        for line in _holding_files_in(str(folder)):  # a failed test leaves nothing running
            os.kill(int(line.split()[0]), 9)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_private_instance_listens_on_loopback_only(private_run: dict) -> None:
    """Its GCS, raylet, workers and agents listened on every interface, the agent's job API
    among them (a job ran as the server's user, no credentials asked)."""
    sockets = private_run["sockets"]
    names = {s[1] for s in sockets}
    assert {"gcs_server", "raylet", "ray::DashboardA"} <= names, sockets
    off_loopback = [s for s in sockets if not _is_loopback(s[2])]
    assert off_loopback == [], off_loopback


def test_a_job_submitted_to_a_private_instance_without_its_token_is_refused(
    private_run: dict,
) -> None:
    jobs = private_run["jobs"]
    assert not [port for port, status in jobs.items() if status in range(200, 300)], jobs
    assert 401 in jobs.values(), jobs  # the agent's job API is there, and asks for the token


def test_a_stopped_private_instance_leaves_no_process_the_agents_included(
    private_run: dict,
) -> None:
    """The agents' process titles can overwrite their environment, where the stop looked for
    its mark: they outlived the stop, still listening. The session folder finds them."""
    agents = {"ray::DashboardA", "ray::RuntimeEnv"}  # /proc's comm: 15 characters
    assert agents <= set(private_run["names"])
    assert private_run["unmarked"] == private_run["names"]
    assert private_run["left"] == []


def test_a_private_instances_processes_are_out_of_reach_of_a_signal_to_its_starters_group(
    private_run: dict,
) -> None:
    """A supervisor's SIGTERM to `selfrag serve`'s process group reached the GCS and raylet
    too, so the answers in progress could not be drained through them."""
    assert private_run["in_my_group"] == []


def test_a_private_instances_workers_run_serve_at_its_periods_or_the_operators(
    private_run: dict,
) -> None:
    """Serve's controller loop and replicas' metrics export ran at Ray's defaults, whose idle
    work took CPU from the engines on a small machine; a value the operator set is kept."""
    from selfrag.runtime.ray_cluster import SERVE_PERIODS

    assert private_run["periods"] == SERVE_PERIODS | {OPERATORS_PERIOD: "250"}
    assert SERVE_PERIODS[OPERATORS_PERIOD] != "250"


def _holding_a_log_in(session: Path) -> subprocess.Popen[bytes]:
    """A Python process with a file open in `session`'s logs, as each of a Ray instance's
    processes has (its agents included, whose titles can overwrite their environment)."""
    (session / "logs").mkdir(parents=True, exist_ok=True)
    code = "import sys, time; f = open(sys.argv[1], 'a'); time.sleep(120)"
    return subprocess.Popen([sys.executable, "-c", code, str(session / "logs" / "agent.out")])


def test_the_next_start_reaps_an_instance_whose_starter_was_killed_and_no_other(
    tmp_path: Path,
) -> None:
    """After a SIGKILL of `selfrag serve`, Ray's agents kept their ports (the job agent's among
    them) for minutes. What a live starter runs, or a cluster without the file, stays."""
    from selfrag.runtime.ray_cluster import OWNER_FILE, _owner_id, reap_orphans

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner = _owner_id(gone.pid)
    gone.wait()
    sessions = {name: tmp_path / f"session_{name}" for name in ("orphan", "live", "cluster")}
    sessions["orphan"].mkdir()
    (sessions["orphan"] / OWNER_FILE).write_text(dead_owner or f"{gone.pid} 0")
    sessions["live"].mkdir()
    (sessions["live"] / OWNER_FILE).write_text(_owner_id(os.getpid()) or "")
    held = {name: _holding_a_log_in(folder) for name, folder in sessions.items()}
    try:
        deadline = time.monotonic() + 10
        while not all(_holding_files_in(str(f)) for f in sessions.values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert reap_orphans() >= 1
        assert held["orphan"].wait(5) == -9
        assert held["live"].poll() is None and held["cluster"].poll() is None
    finally:
        for proc in held.values():
            proc.kill()
            proc.wait()
