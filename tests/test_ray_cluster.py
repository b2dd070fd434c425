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

from tests.redis_proc import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.real


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    # Short: Ray's socket paths under it must stay within the 107 bytes of a Unix socket name.
    folder = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _stale_record(ray_tmp: Path) -> str:
    """What an uncleanly stopped `ray start` leaves: the address of a cluster that is gone."""
    dead = f"127.0.0.1:{free_port()}"
    (ray_tmp / "ray").mkdir(exist_ok=True)
    (ray_tmp / "ray" / "ray_current_cluster").write_text(dead)
    return dead


def _run(
    ray_tmp: Path, code: str, timeout_s: float
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": str(ROOT)}
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
