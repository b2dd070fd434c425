"""Starting or joining Ray for `selfrag serve` and `selfrag batch`.

Without an address (and without `RAY_ADDRESS`), a private single-machine instance: never the
cluster Ray last recorded on this machine (`ray_current_cluster` in Ray's temp folder, written
by `ray start`), which `ray.init(address=None)` would join and, when that cluster is gone,
retry for minutes. With an address, the cluster there must answer within seconds, or the
error names the address.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

# A GCS that is up accepts a connection in milliseconds, even across a data centre.
CONNECT_TIMEOUT_S = 3.0


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
        # Ports on loopback, no cluster token: nobody else joins this instance.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False, log_to_driver=log_to_driver)
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
