"""One driver of a test cluster that answers questions about it for a whole module:
`python -m tests.cluster_probe ADDRESS` reads a line per question from stdin and prints the
cluster's state as one line, `PROBE ` and JSON (Ray may print notes of its own between them).
It joins through the head's raylet, so it outlives a killed worker node. `ClusterProbe`
(tests/ray_cluster.py) starts and asks it: one connection, not a new driver per look."""

from __future__ import annotations

import json
import sys
from typing import Any

PREFIX = "PROBE "


def cluster_state() -> dict[str, Any]:
    """The alive nodes' ids and their exports (id, address, metrics export port), the head's
    id, and every actor the cluster ran (GCS keeps the dead ones): id, class, node (the last it
    ran on), the classes of those alive and the ids of those restarted."""
    import ray
    from ray._private import state

    nodes = ray.nodes()
    actors = state.actors()
    return {
        "head": next(n["NodeID"] for n in nodes if "node:__internal_head__" in n["Resources"]),
        "nodes": [n["NodeID"] for n in nodes if n["Alive"]],
        "exports": [
            [n["NodeID"], n["NodeManagerAddress"], n["MetricsExportPort"]]
            for n in nodes
            if n["Alive"]
        ],
        "actors": [[i, a["ActorClassName"], a["Address"]["NodeID"]] for i, a in actors.items()],
        "alive": [a["ActorClassName"] for a in actors.values() if a["State"] == "ALIVE"],
        "restarted": [i for i, a in actors.items() if a["NumRestarts"] > 0],
    }


def main(address: str) -> None:
    import ray

    ray.init(address=address, log_to_driver=False)
    print(PREFIX + json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        print(PREFIX + json.dumps(cluster_state()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
