"""Sizing the engine actor pool to a Ray cluster's nodes, and watching the nodes while a batch
runs (a lost node that leaves the pool too small stops the run: `NodeLost`)."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from selfrag.runtime.ray_cluster import init_ray
from selfrag.runtime.ray_logs import spend_restart_notice

log = logging.getLogger(__name__)

RETRIEVER_CPUS = 0.1
# Seconds a pool that fits the cluster waits for CPUs still held by actors going away.
RESOURCE_WAIT_S = 10.0
# How often the driver asks the cluster which nodes are alive while a batch runs (two small
# GCS calls); Ray itself takes ~15 s of missed health checks to declare a node dead.
NODE_CHECK_S = 2.0


@dataclass(frozen=True)
class Resources:
    """How the actor pool is sized."""

    actors: int
    actor_cpus: float
    n_threads: int
    per_actor: int


class NodeLost(ConnectionError):
    """A node left the cluster mid-run and the engine pool no longer fits the nodes left: Ray
    Data would wait for ever for the actors it restarts."""


class ClusterTooSmall(ValueError):
    """The engine actors asked for do not fit the nodes of the cluster: Ray would queue them,
    and the job would wait for resources that never come."""


@dataclass(frozen=True)
class NodeCPUs:
    """One alive node's free CPUs, as the planner sees them."""

    node_id: str
    cpus: float
    driver: bool = False


def _fits(nodes: Sequence[NodeCPUs], cpus: float, reserve: float) -> int:
    """How many actors of `cpus` each the nodes hold, `reserve` kept on the driver's node."""
    eps = 1e-9
    return sum(int((n.cpus - (reserve if n.driver else 0.0) + eps) // cpus) for n in nodes)


def _describe(nodes: Sequence[NodeCPUs]) -> str:
    mark = " (the driver's)"
    each = ", ".join(f"{n.node_id[:8]}{mark if n.driver else ''} {n.cpus:g}" for n in nodes)
    plural = "s" if len(nodes) != 1 else ""
    return f"the cluster has {len(nodes)} node{plural} with CPUs free: {each}"


def plan_resources(
    total_cpus: float | Sequence[NodeCPUs],
    actors: int | None,
    per_actor: int,
    n_threads: int,
    actor_cpus: float | None = None,
    reserve: float = RETRIEVER_CPUS,
) -> Resources:
    """Size the engine actor pool to the nodes: an actor runs on one node, so its CPUs must
    fit one node's free CPUs, not the cluster's sum. `total_cpus` is the free CPUs of each
    alive node (a number: one node, the driver's). `reserve`: the retriever's share, kept on
    the driver's node (0 with a Qdrant server).

    Default: one actor per free CPU of each node (at least one per node with a share to
    give), all of the size that fits the smallest of those shares; `actors` fixes the count
    and the size is the largest that fits them all; `actor_cpus` fixes the size. Raises
    ClusterTooSmall, naming what was asked for and what the nodes have, when they do not fit.
    """
    nodes = (
        [NodeCPUs("local", float(total_cpus), True)]
        if isinstance(total_cpus, int | float)
        else list(total_cpus)
    )
    usable = [n.cpus - (reserve if n.driver else 0.0) for n in nodes]
    if actor_cpus is None:
        if actors is None:
            shares = [u / max(1, int(u)) for u in usable if u >= 0.1]
            cpus = math.floor(min(shares, default=0.0) * 20) / 20
        else:
            # The largest size of 0.05 steps at which `actors` fit: one of u / m per node.
            sizes = sorted(
                {math.floor(u / m * 20) / 20 for u in usable for m in range(1, actors + 1)},
                reverse=True,
            )
            cpus = next((c for c in sizes if c >= 0.05 and _fits(nodes, c, reserve) >= actors), 0.0)
    else:
        cpus = actor_cpus
    count = actors if actors is not None else (_fits(nodes, cpus, reserve) if cpus > 0 else 0)
    if cpus <= 0 or count < 1 or _fits(nodes, cpus, reserve) < count:
        asked = f"{actors} engine actors" if actors is not None else "engine actors"
        size = f" of {cpus:g} CPU each" if cpus > 0 else ""
        extra = f", and {reserve:g} CPU for the retriever on the driver's node" if reserve else ""
        raise ClusterTooSmall(
            f"asked for {asked}{size}{extra}; {_describe(nodes)}. An actor runs on one node. "
            "Ask for fewer actors (--actors) or smaller ones (--actor-cpus), or add nodes"
        )
    threads = n_threads or max(1, round(cpus))
    return Resources(count, cpus, threads, per_actor)


def cluster_cpus(total: bool = False) -> list[NodeCPUs]:
    """The free CPUs (`total`: all CPUs) of each alive node of the Ray this process is
    connected to, the driver's node marked."""
    import ray
    from ray._private import state  # Ray is pinned: the per-node view its autoscaler uses

    here = ray.get_runtime_context().get_node_id()
    per_node = state.total_resources_per_node() if total else state.available_resources_per_node()
    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    return [NodeCPUs(i, float(per_node.get(i, {}).get("CPU", 0.0)), i == here) for i in alive]


def plan_on_cluster(
    actors: int | None,
    per_actor: int,
    n_threads: int,
    actor_cpus: float | None,
    reserve: float,
    wait_s: float = RESOURCE_WAIT_S,
) -> Resources:
    """`plan_resources` on the connected cluster's free CPUs. When the pool fits the nodes'
    CPUs but not what is free now (a previous job's actors are still going away), it tries
    again for up to `wait_s`; a pool that fits no node of the cluster fails at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return plan_resources(cluster_cpus(), actors, per_actor, n_threads, actor_cpus, reserve)
        except ClusterTooSmall as exc:
            try:
                plan_resources(
                    cluster_cpus(True), actors, per_actor, n_threads, actor_cpus, reserve
                )
            except ClusterTooSmall:
                raise exc from None  # too small even when idle: waiting cannot help
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def ensure_ray(address: str | None) -> bool:
    """Connect to `address` or start a private local instance (unless Ray already runs in this
    process; `runtime.ray_cluster.init_ray`). True when this call started a private instance,
    so the caller shuts it down. Ray Data's actor pools restart their actors with arguments in
    the object store, which Ray notices on stderr unless -v (`spend_restart_notice`)."""
    started = init_ray(address, log_to_driver=False)
    spend_restart_notice()
    return started


class NodeWatch:
    """The nodes alive when the pool started; `check` raises NodeLost once one of them is gone
    and the pool (`plan`, `reserve` CPUs on the driver's node) no longer fits the nodes left.
    A pool that still fits is left to Ray Data, which restarts the lost actors there.
    `nodes`: the alive nodes with their total CPUs (default: the connected cluster's)."""

    def __init__(
        self,
        plan: Resources,
        reserve: float,
        nodes: Callable[[], list[NodeCPUs]] | None = None,
    ) -> None:
        self._plan = plan
        self._reserve = reserve
        self._nodes = nodes or (lambda: cluster_cpus(total=True))
        self._start = {n.node_id for n in self._nodes()}
        self._told: set[str] = set()

    def check(self) -> None:
        left = self._nodes()
        lost = sorted(self._start - {n.node_id for n in left})
        if not lost:
            return
        names = ", ".join(n[:8] for n in lost)
        plan = self._plan
        if _fits(left, plan.actor_cpus, self._reserve) >= plan.actors:
            if set(lost) - self._told:
                log.warning(
                    "node %s left the cluster; its engine actors restart on the others", names
                )
                self._told |= set(lost)
            return
        plural = "s" if len(lost) > 1 else ""
        each = ", ".join(f"{n.node_id[:8]} {n.cpus:g} CPU" for n in left) or "none"
        raise NodeLost(
            f"node{plural} {names} left the cluster mid-run, and the {plan.actors} engine "
            f"actors of {plan.actor_cpus:g} CPU each no longer fit the nodes left ({each})"
        )


_END = object()


def rows_watched(ds: Any, watch: NodeWatch, every_s: float = NODE_CHECK_S) -> Iterator[Any]:
    """`ds.iter_rows()`, read in a thread of its own so that `watch.check` runs every `every_s`
    even while no row comes (Ray Data blocks until one does). An error of the iteration is
    raised here; leaving early (NodeLost, or the caller stopping) stops the reader at its next
    row and closes Ray Data's iterator there."""
    rows: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()

    def read() -> None:
        iterator = ds.iter_rows()
        try:
            for row in iterator:
                rows.put(row)
                if stop.is_set():
                    break
            rows.put(_END)
        except BaseException as exc:  # handed to the consumer, which raises it
            rows.put(exc)
        finally:
            close = getattr(iterator, "close", None)
            if callable(close):
                close()

    reader = threading.Thread(target=read, name="selfrag-batch-rows", daemon=True)
    reader.start()
    checked = time.monotonic()
    try:
        while True:
            try:
                item = rows.get(timeout=every_s)
            except queue.Empty:
                item = None
            if time.monotonic() - checked >= every_s:
                watch.check()
                checked = time.monotonic()
            if item is None:
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # A reader blocked in Ray Data stays blocked (a daemon thread: the process may exit).
        stop.set()
