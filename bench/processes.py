"""Processes and their memory, from /proc: a process tree's, and a running `selfrag serve`'s Ray
Serve replicas'."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

REPLICA_MARK = "ServeReplica:"


def descendants(*roots: int) -> set[int]:
    """`roots` and every process below them (from /proc/*/stat parent ids)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Field 4 (after the parenthesised command, which may hold spaces) is the parent.
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))
    out: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def vm_rss(pid: int) -> int | None:
    """The resident memory of `pid` in bytes; None once it has ended (or has no memory)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def replica_rss(server_pid: int | None) -> dict[str, int]:
    """VmRSS in bytes of each Ray Serve replica process, as `Deployment[pid]`; only those
    below `server_pid` when given (other Ray instances may run on the same machine)."""
    mine = descendants(server_pid) if server_pid is not None else None
    out: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (mine is not None and int(entry.name) not in mine):
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        if REPLICA_MARK in cmd and (rss := vm_rss(int(entry.name))) is not None:
            # The title is `ray::ServeReplica:app:Deployment.method` while it runs a call.
            name = cmd.split(REPLICA_MARK, 1)[1].split()[0].split(".")[0]
            out[f"{name}[{entry.name}]"] = rss
    return out
