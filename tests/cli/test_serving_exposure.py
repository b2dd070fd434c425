"""What a running `selfrag serve` exposes: `--host` reaches the app's Host check, nothing of its
Ray instance listens off loopback but the HTTP port `--host` names, and what a server killed
outright leaves listening is reaped by the next start, which answers and stops in time."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from selfrag.actors.http.guards import HostCheck
from selfrag.runtime.ray_cluster import OWNER_FILE, wait_for_port
from tests.cli.test_serving_restart import SMALL, STOP_GRACE_S, Server, _owned
from tests.procfs import process_stat
from tests.redis_proc import free_port
from tests.runtime.test_ray_cluster import _is_loopback, listening_sockets


def test_the_host_flag_reaches_the_apps_host_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --host 0.0.0.0` refused every remote client with 421 ("binds a loopback
    address"): the app was built with serve.host, not the flag."""
    from selfrag.cli import serving
    from selfrag.cli.parser import build_parser

    seen = {}

    def captured(args, settings, host, port, starting) -> int:  # type: ignore[no-untyped-def]
        seen.update(settings=settings, host=host, port=port)
        return 0

    monkeypatch.setattr(serving, "_serve", captured)
    port = free_port()
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", str(port)])
    assert serving.cmd_serve(args) == 0
    assert (seen["settings"].serve.host, seen["settings"].serve.port) == ("0.0.0.0", port)
    assert HostCheck.for_bind(seen["settings"].serve.host) is None  # any Host is served


def _instance(server_pid: int) -> set[int]:
    """The live processes of the Ray instance `server_pid` started: marked with its pid, or
    holding files in a session folder that names it (an agent's title can overwrite the mark)."""
    pids = set(_owned(server_pid))
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                head, sep, _ = os.readlink(fd).partition("/logs/")
                owner = Path(head) / OWNER_FILE
                if sep and owner.is_file() and owner.read_text().split()[:1] == [str(server_pid)]:
                    pids.add(int(entry.name))
                    break
        except OSError:
            continue
    return pids


def _process_state(pid: int) -> tuple[str, str] | None:
    """(name, state letter) of a live process or a zombie; None once it is gone."""
    stat = process_stat(pid)
    return None if stat is None else (stat[0], stat[1][0])


def _routed_address() -> str | None:
    """This machine's address on the interface it routes out by (no packet is sent); None
    when it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if _is_loopback(address) else address


@pytest.mark.real
def test_an_open_server_listens_off_loopback_on_its_port_only_and_a_killed_ones_leftovers_go(
    normans_api_home: Path, tmp_path: Path
) -> None:
    """Also the restart a supervisor makes: the next start on the same port answers (not a
    stale proxy sharing the port), and a SIGTERM stops it in time leaving nothing behind."""
    port = free_port()
    keys = {"SELFRAG_API_KEYS": "k1"}
    body = {"question": "Who was the Norse leader of the Normans?", "config": SMALL}
    server = Server(normans_api_home, port, tmp_path / "open.log", host="0.0.0.0", env=keys)
    again: Server | None = None
    try:
        # While it starts (the model check, Ray), the port answers 503 with Retry-After: a
        # client retries instead of meeting a refused connection or Serve's 404.
        starting = server.first_answer(body)
        assert starting.status_code == 503, starting.text
        assert starting.json()["error"] == "not_ready" and starting.headers["retry-after"]
        server.wait_ready()
        instance = _instance(server.proc.pid) | {server.proc.pid}
        sockets = listening_sockets(sorted(instance))
        # Each Serve replica's inter-deployment gRPC server listened on [::]:<random port>.
        off = [s for s in sockets if not _is_loopback(s[2])]
        assert off and all(s[3] == port for s in off), off
        # A remote client, with the key: answered, not refused for its Host.
        auth = {"Authorization": "Bearer k1"}
        remote = _routed_address()
        url = f"http://{remote}:{port}" if remote else server.url
        host = {"Host": f"{remote or 'selfrag.example.org'}:{port}"}
        with httpx.Client(base_url=url, timeout=120) as client:
            assert client.post("/v1/answer", json=body, headers=host).status_code == 401
            r = client.post("/v1/answer", json=body, headers=host | auth)
            assert r.status_code == 200 and r.json()["answer"] is not None, r.text

        # Killed outright: Ray's agents outlive it, holding their ports.
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        time.sleep(2.0)
        left = _instance(server.proc.pid)
        assert left, "nothing of the killed server's instance was left to reap"

        # The next start reaps them before it opens the store or the port.
        again = Server(normans_api_home, port, tmp_path / "again.log")
        again.wait_ready()
        # A zombie counts as gone: it holds no port, and stays until whatever adopted the
        # orphan collects it.
        states = {p: _process_state(p) for p in left}
        running = {p: s for p, s in states.items() if s and s[1] not in ("Z", "X")}
        assert not running, running
        assert "whose starter was killed" in again.log.read_text()
        with httpx.Client(base_url=again.url, timeout=120) as client:
            for _ in range(2):  # the first answer, and the next one after it
                r = client.post("/v1/answer", json=body)
                assert r.status_code == 200 and r.json()["answer"] is not None, r.text
        took = again.stop()
        assert took < STOP_GRACE_S, f"SIGKILL was needed: {again.log.read_text()[-3000:]}"
        assert again.proc.returncode == 0, again.log.read_text()[-3000:]
        # Nothing of its Ray instance is left, the proxy included: the port is free within a
        # few seconds (a killed proxy's listening socket can outlive its process by a moment;
        # `selfrag serve` itself waits up to 60 s).
        assert _owned(again.proc.pid) == []
        wait_for_port("127.0.0.1", port, 5.0)
    finally:
        for started in (server, again):
            if started is not None and started.proc.poll() is None:
                started.stop()
        for pid in _instance(server.proc.pid) | set(_owned(again.proc.pid) if again else []):
            os.kill(pid, signal.SIGKILL)
