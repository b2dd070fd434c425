"""`selfrag serve` stopped the way a supervisor stops it (SIGTERM to its process group, SIGKILL
after 8 s) and started again on the same port: it must stop in time leaving no process of its
Ray instance behind, and the new server, not a stale proxy sharing the port, must answer.

The port guard (`wait_for_port`) is checked here without Ray too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from selfrag.runtime.ray_cluster import OWNER_ENV, PortInUse, port_holder, wait_for_port
from tests.real import real
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


@pytest.fixture
@real
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:  # a failed test leaves nothing running
        if server.proc.poll() is None:
            server.stop()
        for pid in _owned(server.proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_server_restarted_on_the_same_port_answers(
    normans_api_home: Path, tmp_path: Path, servers: list[Server]
) -> None:
    port = free_port()
    body = {"question": "Who was the Norse leader of the Normans?", "config": SMALL}
    for n in (1, 2):
        server = Server(normans_api_home, port, tmp_path / f"serve{n}.log")
        servers.append(server)
        # While it starts (the model check, Ray), the port answers 503 with Retry-After: a
        # client retries instead of meeting a refused connection or Serve's 404.
        starting = server.first_answer(body)
        assert starting.status_code == 503, starting.text
        assert starting.json()["error"] == "not_ready" and starting.headers["retry-after"]
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for _ in range(2):  # the first answer, and the next one after it
                r = client.post("/v1/answer", json=body)
                assert r.status_code == 200 and r.json()["answer"] is not None, r.text
        took = server.stop()
        assert took < STOP_GRACE_S, f"server {n} needed SIGKILL: {server.log.read_text()[-3000:]}"
        assert server.proc.returncode == 0, server.log.read_text()[-3000:]
        # Nothing of its Ray instance is left, the proxy included: the port is free within a
        # few seconds (a killed proxy's listening socket can outlive its process by a moment:
        # seen once in 2 CI-like runs with 0 s; `selfrag serve` itself waits up to 60 s).
        assert _owned(server.proc.pid) == []
        wait_for_port("127.0.0.1", port, 5.0)
