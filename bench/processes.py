"""Processes of a running `selfrag serve`: its Ray Serve replicas and their memory, from /proc."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

REPLICA_MARK = "ServeReplica:"


def _descendants(root: int) -> set[int]:
    """`root` and every process below it (from /proc/*/stat parent ids)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Field 4 (after the parenthesised command, which may hold spaces) is the parent.
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


def replica_rss(server_pid: int | None) -> dict[str, int]:
    """VmRSS in bytes of each Ray Serve replica process, as `Deployment[pid]`; only those
    below `server_pid` when given (other Ray instances may run on the same machine)."""
    mine = _descendants(server_pid) if server_pid is not None else None
    out: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (mine is not None and int(entry.name) not in mine):
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if REPLICA_MARK not in cmd:
                continue
            status = (entry / "status").read_text()
        except OSError:  # the process ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                # The title is `ray::ServeReplica:app:Deployment.method` while it runs a call.
                name = cmd.split(REPLICA_MARK, 1)[1].split()[0].split(".")[0]
                out[f"{name}[{entry.name}]"] = int(line.split()[1]) * 1024
    return out
