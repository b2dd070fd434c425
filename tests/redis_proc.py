"""A real `redis-server` child process on a free loopback port, which tests may kill and
restart; or, where no `redis-server` binary exists, the server named by
`$REDIS_TEST_URL` (then it cannot be killed and such tests skip). The variable is not
named SELFRAG_*: that prefix is reserved for settings, which reject unknown names."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

TEST_REDIS_URL_ENV = "REDIS_TEST_URL"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """`redis-server` without persistence, owned by the test session."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary = binary
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer within 10 s")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no goodbye to connected clients."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


def redis_or_skip() -> tuple[str, RedisProcess | None]:
    """(url, process): our own server when `redis-server` exists, else the environment's."""
    binary = shutil.which("redis-server")
    if binary is not None:
        proc = RedisProcess(binary, free_port())
        proc.start()
        return proc.url, proc
    url = os.environ.get(TEST_REDIS_URL_ENV)
    if url:
        return url, None
    if os.environ.get("CI"):
        pytest.fail("CI must provide redis-server (.ci/run installs it)")
    pytest.skip(f"no redis-server on PATH and no ${TEST_REDIS_URL_ENV}")
