"""The disruptions bench/soak.py injects into its run (a Redis kill, an engine replica kill, a
server restart on the same port), the server and redis-server processes it owns for them, and
which failures each disruption excuses (see bench/soak.py's docstring)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.serve_load import wait_ready

STOP_GRACE_S = 8.0


class Server:
    """`selfrag serve --port P` in a process group of its own, stopped as a supervisor stops
    it: SIGTERM to the group, SIGKILL after STOP_GRACE_S."""

    def __init__(self, home: str | None, port: int, env: dict[str, str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._port, self._home, self._env, self._log = port, home, env, log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, ready_limit_s: float = 600.0) -> float:
        """Start and wait until /readyz is 200; the seconds that took."""
        env = {**os.environ, **self._env}
        if self._home:
            env["SELFRAG_HOME"] = self._home
        cmd = [sys.executable, "-m", "selfrag.cli", "serve", "--port", str(self._port)]
        started = time.monotonic()
        with self._log.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=log, start_new_session=True
            )
        wait_ready(self.url, self.proc, ready_limit_s)
        return time.monotonic() - started

    def stop(self) -> tuple[float, bool]:
        """(seconds the stop took, whether it needed SIGKILL)."""
        assert self.proc is not None
        started = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
            return time.monotonic() - started, False
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return time.monotonic() - started, True


class RedisServer:
    """A redis-server of this script's own on a free loopback port (no persistence)."""

    def __init__(self, binary: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._binary = binary
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer within 10 s")

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


@dataclass
class Window:
    """A deliberate disruption: `kind`, from `start` until `end` (None while it lasts)."""

    kind: str
    start: float
    end: float | None = None


# The failures each disruption causes by design (`one_request`'s reasons); nothing else is
# excused, and nothing at all for a Redis outage (the cache bypasses it).
EXCUSED = {
    "replica": ("stream ended with its error event",),
    "restart": (
        "ConnectError",
        "ConnectTimeout",
        "ReadError",
        "RemoteProtocolError",
        "WriteError",
        "HTTP 500",
        "HTTP 502",
        "stream ended",
    ),
}
# Excused for requests that arrive after a restart's SIGTERM only: one in flight then must end
# with its answer (the stop drains), and a 404 (Serve's proxy before its app is deployed) is
# never excused: until ready the answer is a 503 with Retry-After.
DRAINED = ("restart",)


class Disruptions:
    """The run's disruption windows, and the classification of a failure against them."""

    def __init__(self) -> None:
        self.windows: list[Window] = []
        self.log: list[str] = []
        self._lock = threading.Lock()

    def open(self, kind: str) -> Window:
        window = Window(kind, time.monotonic())
        with self._lock:
            self.windows.append(window)
        return window

    def excused(self, started: float, ended: float, why: str) -> bool:
        """Whether a request that ran from `started` to `ended` and failed for `why` overlaps
        a window whose disruption fails requests that way."""
        with self._lock:
            windows = list(self.windows)
        return any(
            w.start <= ended
            and (w.end is None or w.end >= started)
            and not (w.kind in DRAINED and started < w.start)
            and any(why.startswith(p) for p in EXCUSED.get(w.kind, ()))
            for w in windows
        )

    def in_flight_at_stop(self, started: float, ended: float) -> bool:
        """Whether a request ran across the start of a restart (it had to be drained)."""
        with self._lock:
            windows = list(self.windows)
        return any(w.kind in DRAINED and started < w.start <= ended for w in windows)


def wait_readyz(url: str, limit_s: float) -> float:
    """Poll /readyz until 200; the seconds it took (inf if not within `limit_s`)."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return float("inf")


def inject(
    kind: str,
    disruptions: Disruptions,
    server: Server | None,
    redis: RedisServer | None,
    redis_down_s: float,
    figures: Counter[str],
    engine_replica: Callable[[int], int | None],
) -> None:
    """Carry out one disruption and close its window; its story goes to `disruptions.log`.
    `engine_replica(server_pid)`: the pid of the replica a `replica` event kills."""
    t0 = time.monotonic()
    if kind == "redis":
        assert redis is not None, "a redis event needs this script's redis-server"
        window = disruptions.open(kind)
        redis.kill()
        time.sleep(redis_down_s)
        redis.start()
        window.end = time.monotonic()
        figures["redis_kills"] += 1
        note = f"redis-server killed, restarted {redis_down_s:.0f} s later"
    elif kind == "replica":
        assert server is not None and server.pid is not None
        pid = engine_replica(server.pid)
        if pid is None:
            disruptions.log.append(f"replica: no BranchPool replica found at {t0:.0f}")
            return
        window = disruptions.open(kind)
        os.kill(pid, signal.SIGKILL)
        time.sleep(2.0)  # /readyz may still pass before Serve notices the replica is gone
        back = wait_readyz(server.url, 300)
        window.end = time.monotonic()
        figures["replica_kills"] += 1
        note = f"BranchPool replica pid {pid} killed; /readyz 200 again after {2 + back:.1f} s"
    elif kind == "restart":
        assert server is not None
        window = disruptions.open(kind)
        took, killed = server.stop()
        ready = server.start()
        window.end = time.monotonic()
        figures["restarts"] += 1
        figures["restart_sigkills"] += int(killed)
        figures["restart_stop_ms_max"] = max(figures["restart_stop_ms_max"], round(took * 1000))
        note = (
            f"server stopped in {took:.1f} s ({'SIGKILL needed' if killed else 'no SIGKILL'}), "
            f"started again on the same port, ready after {ready:.0f} s"
        )
    else:
        raise ValueError(f"unknown event {kind!r}")
    disruptions.log.append(f"{kind}: {note}")
    print(f"  event {kind}: {note}", flush=True)


def parse_events(spec: str) -> list[tuple[str, float]]:
    """`kind@fraction,...` (fractions of the run) as a sorted list."""
    events = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        kind, _, at = item.partition("@")
        if kind not in ("redis", "replica", "restart") or not 0 < float(at or "nan") < 1:
            raise SystemExit(f"--events: {item!r} is not redis|replica|restart@fraction")
        events.append((kind, float(at)))
    return sorted(events, key=lambda e: e[1])
