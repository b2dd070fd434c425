"""Starting or joining Ray for `selfrag serve` and `selfrag batch`.

Without an address (and without `RAY_ADDRESS`), a private single-machine instance: never the
cluster Ray last recorded on this machine (`ray_current_cluster` in Ray's temp folder, written
by `ray start`), which `ray.init(address=None)` would join and, when that cluster is gone,
retry for minutes. With an address, the cluster there must answer within seconds, or the
error names the address.

A private instance is reachable from this machine only, and only with its own credential:
its node address is 127.0.0.1, so the GCS, raylet, workers and agents listen on loopback (Ray
otherwise swaps 127.0.0.1 for the address the machine routes out by, and its gRPC servers listen
on every interface), and it runs in Ray's token mode with a random token that only its own
processes inherit, which the GCS, raylet and the dashboard agent's HTTP API (job submission
among it) require. No dashboard is started.

Serve's replicas also serve each other over gRPC, on a port Ray 2.60 binds on every interface
(`[::]:0`, with no setting); `loopback_replica_grpc`, called in each replica before Serve opens
that port, binds it to the node's address instead when that is loopback (the callers dial the
node's address).

`stop_private_ray` finds the processes of a private instance by its session folder, which each
of them holds files open in (its logs), and by `OWNER_ENV`, which each inherits: a process title
can overwrite the start of the environment block (Ray's agents: "ray::DashboardAgent"), open
files it cannot. Ray's workers run in process groups of their own, so a signal to `selfrag
serve`'s process group does not reach them, and they outlive a killed GCS and raylet for a
while; Serve's HTTP proxy among them keeps its port, bound with SO_REUSEPORT, which a new proxy
on that port would then share with it. `wait_for_port` keeps a new server from sharing a port
with anything. A starter killed outright stops nothing: its instance's agents keep their ports
(the job agent's among them) for minutes. So the session folder names its starter
(`OWNER_FILE`), and the next private start (`reap_orphans`) kills what is left of instances whose
starter is gone.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

# A GCS that is up accepts a connection in milliseconds, even across a data centre.
CONNECT_TIMEOUT_S = 3.0
# The environment variable that marks the processes of a private instance (not SELFRAG_*: that
# prefix is for settings). Its value is unique per instance.
OWNER_ENV = "RAY_SELFRAG_OWNER"
# How long `stop_private_ray` waits for the killed processes to be gone.
STOP_WAIT_S = 5.0
# How long ray.shutdown may take once every process of the instance is gone (it only tidies
# this process's own state then, and can wait on the dead GCS).
RAY_SHUTDOWN_S = 2.0
# The processes of a Ray node that are not workers (their /proc `comm`).
DAEMONS = frozenset({"gcs_server", "raylet"})
# The node address of a private instance.
LOOPBACK = "127.0.0.1"
# Ray Serve's periods in a private instance: its controller's loop and each replica's export of
# cached metrics run far more often by default than one machine's autoscaling and metrics need,
# and on a small machine that idle work takes CPU from the engines' threads
# (docs/cluster.md, "Serve's periods"). A value already in the environment is kept.
SERVE_PERIODS = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
# The session folder of the private instance this process started (None: none).
_session: Path | None = None
# The file in a private instance's session folder that names its starter: "PID START", START
# the process's start time in clock ticks since boot (/proc/PID/stat), so a reused pid is not
# taken for it.
OWNER_FILE = "selfrag_owner"
# How long `selfrag serve` waits for its port to be released by a server stopped just before.
PORT_WAIT_S = 60.0


class RayUnavailable(ConnectionError):
    """No Ray cluster answers at the address asked for."""


def init_ray(address: str | None, *, log_to_driver: bool) -> bool:
    """Start a private Ray instance, or join the cluster at `address` ("host:port",
    "ray://host:port", "auto"; None falls back to `RAY_ADDRESS`, then to a private instance).

    True when this call started a private instance (the caller shuts it down); False when it
    joined a cluster or Ray already runs in this process. Raises RayUnavailable, within about
    CONNECT_TIMEOUT_S, when nothing answers at the address.
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    target = None if address in (None, "local") else _target(address)
    if target is None:
        reap_orphans()
        _private_environment()
        with _daemons_in_their_own_group():
            ray.init(
                address="local",
                include_dashboard=False,
                log_to_driver=log_to_driver,
                _node_ip_address=LOOPBACK,
            )
        global _session
        _session = Path(ray._private.worker._global_node.get_session_dir_path())
        (_session / OWNER_FILE).write_text(_owner_id(os.getpid()) or "")
        return True
    host, port, shown = target
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise RayUnavailable(
            f"no Ray cluster answers at {shown}: {exc}. Check the address (the head's GCS "
            "port, 6379 by default), or leave out --address to start a private instance"
        ) from None
    # The address as given ("auto" included): ray.init resolves it the same way.
    ray.init(address=address, include_dashboard=False, log_to_driver=log_to_driver)
    return False


def _private_environment() -> None:
    """What every process of a private instance inherits from this one: loopback as the node
    address, Ray's token mode with a token of its own, the `OWNER_ENV` mark and Serve's
    `SERVE_PERIODS` (unless set)."""
    from ray._private import ray_constants
    from ray._raylet import Config

    # Ray swaps 127.0.0.1 for the machine's routed address unless "clusters" are off, which it
    # reads from this variable when it is imported (already done here): both are set. Ray is
    # pinned, so these internals are the ones this code was tested with.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Forced, not defaulted: an inherited RAY_AUTH_MODE=disabled would open the instance again.
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_urlsafe(32)
    Config.initialize("")  # this process read its Ray config at import: read the mode again
    os.environ[OWNER_ENV] = f"{os.getpid()}-{secrets.token_hex(8)}-{_owner_id(os.getpid())}"
    for name, value in SERVE_PERIODS.items():
        os.environ.setdefault(name, value)


@contextmanager
def _daemons_in_their_own_group() -> Iterator[None]:
    """Ray's daemons (GCS, raylet, agents, monitors) started meanwhile get a process group of
    their own: a supervisor's SIGTERM to `selfrag serve`'s group then reaches `selfrag serve`
    alone, which drains the answers in progress through them before it stops them all. They
    still die with it if it is killed (Ray starts them with the parent-death signal)."""
    from ray._private import services

    popen = services.ConsolePopen

    class OwnGroup(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroup  # Ray is pinned: its one way of starting a daemon
    try:
        yield
    finally:
        services.ConsolePopen = popen


def loopback_replica_grpc() -> None:
    """In a Serve replica on a node whose address is loopback (a private instance), make the
    replica's inter-deployment gRPC server bind that address instead of every interface: Ray
    2.60 binds it to `[::]:0` with no setting, and its callers dial the node's address and the
    port. Call it in the replica before Serve opens that server (the deployment's
    constructor); elsewhere (a cluster's node, no Ray) it changes nothing. Ray is pinned, so
    this internal name is the one this code was tested with."""
    import ray

    if not ray.is_initialized():
        return
    node = str(ray.get_runtime_context().worker.node_ip_address or "")
    if not _is_loopback(node):
        return
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server
    if getattr(bind, "selfrag_node", None) is not None:
        return

    def on_node_address(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return int(bind(server, f"{node}:{port}" if host == "[::]" else address))

    on_node_address.selfrag_node = node  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_node_address


def _is_loopback(address: str) -> bool:
    from selfrag.infra.settings_loader import is_loopback

    return bool(address) and is_loopback(address)


def _owner_id(pid: int) -> str | None:
    """ "PID START" of a live process (START: its start time, /proc/PID/stat's 22nd field),
    which a later process with the same pid does not share; None when it is gone (or there is
    no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid} {stat.rsplit(')', 1)[1].split()[19]}"


class _SessionOwners:
    """Whether a file open in a Ray session folder belongs to a private instance whose starter
    is gone: the folder's `OWNER_FILE` names a process no longer running (read once per
    folder)."""

    def __init__(self) -> None:
        self._gone: dict[str, bool] = {}

    def orphaned(self, target: str) -> bool:
        head, sep, _ = target.partition("/logs/")
        if not sep or "/session_" not in head:
            return False
        if head not in self._gone:
            try:
                owner = (Path(head) / OWNER_FILE).read_text().strip()
            except OSError:
                owner = ""  # not a private instance of selfrag's, or not readable
            self._gone[head] = bool(owner) and _owner_id(int(owner.split()[0])) != owner
        return self._gone[head]


def _orphaned_mark(entry: Path) -> bool:
    """Whether the process at /proc `entry` carries an `OWNER_ENV` mark naming a starter that
    is gone."""
    for item in (entry / "environ").read_bytes().split(b"\0"):
        if item.startswith(f"{OWNER_ENV}=".encode()):
            parts = item.decode(errors="replace").split("=", 1)[1].split("-")
            if len(parts) == 3 and parts[2]:  # PID-TOKEN-"PID START"
                return _owner_id(int(parts[0])) != parts[2]
    return False


def reap_orphans(wait_s: float = STOP_WAIT_S) -> int:
    """SIGKILL what is left of the private instances whose starter is gone (killed outright,
    it stopped nothing): every process running Ray or this Python that holds files open in a
    session folder whose `OWNER_FILE` names a process no longer running, or whose
    `OWNER_ENV` mark names one; then wait up to `wait_s` for them to be gone, so that their
    ports are free. Instances whose starter runs, and clusters (no such file), are left
    alone. Returns how many were killed."""
    if not Path("/proc/self/stat").exists():
        return 0
    sessions = _SessionOwners()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if not _runs_ray(entry):
                continue
            targets = (os.readlink(fd) for fd in (entry / "fd").iterdir())
            if _orphaned_mark(entry) or any(map(sessions.orphaned, targets)):
                found.append(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile, another user's, or a stranger's mark
            continue
    if found:
        log.info(
            "stopping %d processes of a private Ray instance whose starter was killed (its "
            "agents and workers keep their ports until then)",
            len(found),
        )
    return _kill(found, wait_s)


def starts_private(address: str | None) -> bool:
    """Whether `init_ray(address)` would start a private instance here."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    return address in (None, "local") or _target(address) is None


def _target(address: str) -> tuple[str, int, str] | None:
    """(host, port, how to name it in a message) of the cluster `address` points at; None
    when it asks for a private instance ("auto" with RAY_ADDRESS=local)."""
    if "://" in address:  # a Ray Client address: its server must answer
        parts = urlsplit(address)
        if parts.hostname is None or parts.port is None:
            raise RayUnavailable(f"the Ray address {address!r} needs a host and a port")
        return parts.hostname, parts.port, address
    shown = address
    if address == "auto":
        # Ray's own resolution (RAY_ADDRESS, the cluster `ray start` recorded, a GCS process
        # running here), so that exactly the address ray.init would try is checked. Ray is
        # pinned, so this internal function is the one this code was tested with.
        from ray._private.services import canonicalize_bootstrap_address

        try:
            resolved = canonicalize_bootstrap_address("auto")
        except ConnectionError:
            raise RayUnavailable(
                "--address auto: no Ray cluster runs on this machine (start one with "
                "`ray start --head`, or leave out --address to start a private instance)"
            ) from None
        if resolved is None:
            return None
        address = resolved
        shown = (
            f"{resolved} (where --address auto points: RAY_ADDRESS, or the cluster that "
            "`ray start` last recorded on this machine)"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RayUnavailable(
            f"the Ray address {address!r} is not host:port, ray://host:port or auto"
        )
    return host.strip("[]"), int(port), shown


def private_ray_processes() -> list[int]:
    """The live processes of the private instance this process started, this process
    excluded: those holding a file open in its session folder, or whose environment holds
    its `OWNER_ENV` value; [] when it started none."""
    mark = os.environ.get(OWNER_ENV)
    if (not mark and _session is None) or not Path("/proc/self/environ").exists():
        return []  # none started, or no /proc (not Linux): unknown
    needle = f"{OWNER_ENV}={mark}".encode() if mark else None
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            # A zombie's environment reads empty and its files are closed: only live ones match.
            if (_session is not None and _runs_ray(entry) and _holds_files_in(entry, _session)) or (
                needle is not None and needle in (entry / "environ").read_bytes().split(b"\0")
            ):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def _runs_ray(process: Path) -> bool:
    """Whether the process `/proc/<pid>` runs this Python (Ray's workers and agents) or one of
    Ray's programs (GCS, raylet): not, say, a `tail -f` of a log in the session folder."""
    exe = os.path.realpath(process / "exe")
    return exe == os.path.realpath(sys.executable) or exe.startswith(_ray_folder())


@functools.cache
def _ray_folder() -> str:
    import ray

    return f"{Path(ray.__file__).resolve().parent}/"


def _holds_files_in(process: Path, folder: Path) -> bool:
    """Whether the process `/proc/<pid>` has a file open under `folder`."""
    prefix = f"{folder}/"
    for fd in (process / "fd").iterdir():
        try:
            if os.readlink(fd).startswith(prefix):
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def stop_private_ray(keep: frozenset[str] = frozenset(), wait_s: float = STOP_WAIT_S) -> int:
    """SIGKILL every process of the private instance this process started (its GCS and raylet
    if alive, and the workers, Serve's proxy and replicas among them, which nothing else ends
    when the GCS and raylet went first), but those named in `keep` (/proc's `comm`), then wait
    up to `wait_s` for them to be gone, so that the ports they held are free. Returns how many
    were killed."""
    return _kill([pid for pid in private_ray_processes() if _name(pid) not in keep], wait_s)


def _kill(pids: list[int], wait_s: float) -> int:
    """SIGKILL `pids`, then wait up to `wait_s` for them to be gone; how many there were."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while any(map(_exiting, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(pids)


def _exiting(pid: int) -> bool:
    """Whether `pid` still runs or is still exiting. A zombie has closed its files (sockets
    included); its environment reads empty earlier, while its memory is being freed."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def shutdown_private_ray(tidy: bool = True) -> None:
    """End the private instance this process started, Serve included, leaving no process of it
    behind: this process disconnects (`tidy`), then the workers (Serve's proxy, controller and
    replicas) are killed, then the GCS, raylet and anything left. Serve's graceful shutdown is not
    attempted: after a signal to the whole process group, which reaches the raylet too, it
    hung beyond the grace a supervisor usually gives a stop; requests in flight end with it.
    `tidy`: this process disconnects (ray.shutdown, bounded) before the GCS and raylet are
    killed, so that it is not told its node died; without it the caller had better exit at
    once (`os._exit`)."""
    import ray

    global _session
    if tidy:
        # Disconnected while the instance still runs: a driver still connected when its
        # raylet goes (it goes with its agents too) reports the node dead ("raylet crashes
        # unexpectedly") and exits with 1.
        _bounded(ray.shutdown, RAY_SHUTDOWN_S)
    stop_private_ray(keep=DAEMONS)  # the proxy's port is free from here on
    stop_private_ray()
    _session = None


def _bounded(call: Callable[[], object], limit_s: float) -> None:
    """`call()` in a daemon thread, waited for up to `limit_s`: a shutdown step that hangs on
    a dead peer must not keep the process from exiting."""
    thread = threading.Thread(target=call, name="selfrag-shutdown", daemon=True)
    thread.start()
    thread.join(limit_s)


class PortInUse(OSError):
    """The HTTP port is held by another process (named when /proc says which)."""


def wait_for_port(
    host: str, port: int, wait_s: float, waiting: Callable[[str], None] | None = None
) -> None:
    """Return once `port` on `host` can be bound by this process alone; PortInUse when it is
    still held after `wait_s`. Serve's proxy binds with SO_REUSEPORT, which would let a new
    server share a port with a stale proxy (each then gets part of the connections), so the
    check binds without it. `waiting(holder)` is called once when it has to wait."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # SO_REUSEADDR only passes over connections in TIME_WAIT, never over a listener.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        listeners = _listening(port)
        if listeners is not None and not listeners:
            return  # only connections of a process gone, closing: Serve's bind passes them
        holder = port_holder(port)
        if time.monotonic() >= deadline:
            raise PortInUse(
                errno.EADDRINUSE,
                f"port {port} on {host} is in use{f' by {holder}' if holder else ''} "
                f"(waited {wait_s:.0f} s): stop that process, or choose another --port",
            )
        if not told and waiting is not None:
            waiting(holder or "another process")
            told = True
        time.sleep(0.25)


def _listening(port: int) -> set[str] | None:
    """The `socket:[inode]` names of the sockets listening on TCP `port`, from /proc; None
    where /proc does not tell."""
    inodes: set[str] = set()
    tables = [Path(t) for t in ("/proc/net/tcp", "/proc/net/tcp6") if Path(t).exists()]
    if not tables:
        return None
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            return None
        for line in lines:
            fields = line.split()
            # local address "ADDR:PORT" in hex; state 0A is LISTEN.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    return inodes


def port_holder(port: int) -> str | None:
    """`pid N (name)` of a process listening on TCP `port`, from /proc; None if unknown."""
    inodes = _listening(port)
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    name = (entry / "comm").read_text().strip()
                    return f"pid {entry.name} ({name})"
        except OSError:
            continue
    return None
