"""`selfrag serve` as a supervisor runs it (`Server`: its own process group; SIGTERM, SIGKILL
after 8 s), for the tests that start and restart it (`test_serving_exposure.py`); and the port
guard (`wait_for_port`), checked here without Ray.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from selfrag.runtime.ray_cluster import OWNER_ENV, PortInUse, port_holder, wait_for_port
from tests.redis_proc import free_port

SMALL = {"mode": "always", "top_k": 2, "max_segments": 1, "max_segment_tokens": 16}
STOP_GRACE_S = 8.0


def _listener(port: int, reuse_port: bool) -> socket.socket:
    s = socket.socket()
    if reuse_port:  # as Serve's proxy binds
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_port_a_proxy_holds_is_waited_for_then_refused_with_its_holder() -> None:
    port = free_port()
    held = _listener(port, reuse_port=True)
    try:
        assert (port_holder(port) or "").startswith(f"pid {os.getpid()} (")
        told: list[str] = []
        started = time.monotonic()
        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 is in use by pid"):
            wait_for_port("127.0.0.1", port, 0.5, told.append)
        assert time.monotonic() - started >= 0.5 and len(told) == 1
        # Released while waiting: the wait ends there.
        threading.Timer(0.3, held.close).start()
        wait_for_port("127.0.0.1", port, 10.0)
    finally:
        held.close()
    wait_for_port("127.0.0.1", port, 0.0)  # free: no wait at all


def _owned(server_pid: int) -> list[int]:
    """Live processes of the private Ray instance the server `server_pid` started."""
    prefix = f"{OWNER_ENV}={server_pid}-".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(v.startswith(prefix) for v in (entry / "environ").read_bytes().split(b"\0")):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


class Server:
    """`selfrag serve --port P` in a process group of its own, as a supervisor runs it;
    `host`: its `--host`, `env`: more of its environment."""

    def __init__(
        self,
        home: Path,
        port: int,
        log: Path,
        host: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        env = {
            **os.environ,
            "SELFRAG_HOME": str(home),
            "SELFRAG_MODEL__N_THREADS": "1",
            **(env or {}),
        }
        cmd = [sys.executable, "-m", "selfrag.cli", "serve", "--port", str(port)]
        cmd += ["--host", host] if host else []
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=out, start_new_session=True
            )

    def wait_ready(self, limit_s: float = 300.0) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/readyz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"not ready within {limit_s:.0f} s: {self.log.read_text()[-3000:]}")

    def first_answer(self, body: dict[str, object], limit_s: float = 120.0) -> httpx.Response:
        """The first response to `body` on /v1/answer, asked from the moment the process
        starts (connection errors are retried)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                return httpx.post(self.url + "/v1/answer", json=body, timeout=120)
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError(f"nothing answered within {limit_s:.0f} s")

    def stop(self) -> float:
        """SIGTERM to the group, SIGKILL after STOP_GRACE_S; the seconds the stop took."""
        started = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return float("inf")
        return time.monotonic() - started
