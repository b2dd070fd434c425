"""A private network namespace that holds only loopback, for tests whose servers must be
reachable from nowhere else. Ray's nodes bind and report the machine's address whatever
`--node-ip-address` says (it resolves 127.0.0.1 to the address the machine routes out by); in
a namespace with no other interface that address is 127.0.0.1, and nothing outside can reach
the servers or be reached by them.

`LoopbackNamespace.entered()` moves the calling thread into it: the processes and threads it
starts are born there, and its sockets are the namespace's. Needs CAP_SYS_ADMIN (root)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CLONE_NEWNET = 0x40000000

# The holder: brings `lo` up (SIOCGIFFLAGS / SIOCSIFFLAGS with IFF_UP; no iproute2 needed),
# says so, and keeps the namespace alive until it is killed.
_HOLDER = """
import fcntl, signal, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0))[:18])[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
print("ready", flush=True)
signal.pause()
"""


class NamespaceUnavailable(RuntimeError):
    """This process may not make or enter a network namespace (not root)."""


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class LoopbackNamespace:
    """A new network namespace with `lo` up and no other interface, held by a child process
    (`unshare --net`) until `close`."""

    def __init__(self, timeout_s: float = 30) -> None:
        try:
            self._holder = subprocess.Popen(
                ["unshare", "--net", "--", sys.executable, "-c", _HOLDER],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise NamespaceUnavailable("no `unshare` (util-linux) on this machine") from exc
        assert self._holder.stdout is not None
        line = self._holder.stdout.readline()  # "ready", or EOF when unshare failed
        if line.strip() != b"ready":
            _, err = self._holder.communicate(timeout=timeout_s)
            raise NamespaceUnavailable(
                f"unshare --net failed: {err.decode(errors='replace').strip()}"
            )
        self.path = Path(f"/proc/{self._holder.pid}/ns/net")

    def interfaces(self) -> list[str]:
        """The namespace's network interfaces, as its own /proc/net/dev lists them."""
        code = "print(open('/proc/thread-self/net/dev').read())"
        with self.entered():
            text = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout
        return [line.split(":")[0].strip() for line in text.splitlines()[2:] if ":" in line]

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Move the calling thread into the namespace for the block, then back."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(self.path, os.O_RDONLY)
        try:
            try:
                _setns(target)
            except PermissionError as exc:
                raise NamespaceUnavailable(f"cannot enter {self.path}: {exc}") from exc
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(target)
            os.close(home)

    def close(self) -> None:
        try:
            os.killpg(self._holder.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._holder.wait()
