"""Which files of a folder a corpus read opens, and how it reads one safely: symbolic links
that leave the folder are not followed (unless asked), pseudo filesystems (/proc, /sys, /dev)
and special files (FIFOs, devices, sockets) are never read, and no file is read past a size
limit, whatever size it claims. Everything passed over comes back with its reason."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Pseudo filesystems: their files say size 0 and may be endless or secret (/proc/self/environ).
_PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


@dataclass(frozen=True)
class Passed:
    """A file or folder not read, and why."""

    path: str
    reason: str


def too_big(size: int, max_bytes: int) -> str:
    return f"document too large ({size} bytes, limit {max_bytes}; retrieval.max_document_bytes)"


def folder_files(
    folder: Path, follow_links: bool, suffixes: frozenset[str]
) -> Iterator[Path | Passed]:
    """The files of `folder` to read (those ending in one of `suffixes`), sorted, and a
    `Passed` with its reason for each one not read: a symbolic link that leaves the folder
    (unless `follow_links`), a file of another format. Hidden files and folders (editor and
    VCS state) are passed over quietly, and so are links that stay inside (their targets are
    read where they are). Never follows a link into a pseudo filesystem (/proc, /sys, /dev);
    a link loop is never walked twice."""
    root = folder.resolve()
    seen_dirs = {root}
    todo = [folder]
    found: list[Path | Passed] = []
    while todo:
        current = todo.pop()
        try:
            entries = sorted(os.scandir(current), key=lambda e: e.name)
        except OSError as error:
            found.append(Passed(str(current), f"cannot list the folder ({error})"))
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            if entry.is_symlink():
                target = path.resolve()
                inside = target == root or root in target.parents
                if inside:
                    continue  # read where it lies in the folder
                if not follow_links or is_pseudo(target):
                    why = "a pseudo filesystem" if is_pseudo(target) else "outside the folder"
                    found.append(
                        Passed(
                            str(path),
                            f"symbolic link to {target}, {why}: not followed"
                            + ("" if is_pseudo(target) else " (--follow-links reads it)"),
                        )
                    )
                    continue
            try:
                is_dir = entry.is_dir()  # follows a link allowed above
            except OSError:
                is_dir = False
            if is_dir:
                real = path.resolve()
                if real not in seen_dirs:
                    seen_dirs.add(real)
                    todo.append(path)
                continue
            if path.suffix.lower() not in suffixes:
                found.append(
                    Passed(
                        str(path),
                        f"not a format selfrag reads ({'/'.join(sorted(suffixes))})",
                    )
                )
                continue
            found.append(path)
    return iter(sorted(found, key=_item_path))


def _item_path(item: Path | Passed) -> str:
    return item.path if isinstance(item, Passed) else str(item)


def is_pseudo(path: Path) -> bool:
    """Whether `path` (resolved) lies in /proc, /sys or /dev."""
    text = str(path)
    return any(text == r or text.startswith(r + "/") for r in _PSEUDO_ROOTS)


def read_bounded(file: Path, max_bytes: int) -> bytes | str:
    """The bytes of a regular file, or why they are not read: a special file (FIFO, device,
    socket), a file of a pseudo filesystem, or one over `max_bytes`. The file is opened without
    blocking and checked on its descriptor, then read to at most `max_bytes` + 1 bytes, so a
    file that lies about its size cannot make this read on."""
    real = file.resolve()
    if is_pseudo(real):
        return f"{real} is in a pseudo filesystem: never read"
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        return f"cannot open ({error.strerror or error})"
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file (a FIFO, device or socket): never read"
        if info.st_size > max_bytes:
            return too_big(info.st_size, max_bytes)
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        return too_big(len(data), max_bytes)
    return data


def file_source(file: Path) -> str:
    """A file's `Document.source`: its absolute path, the folders resolved but not the file
    itself, so a link followed out of a folder is still found under it."""
    return str(file.parent.resolve() / file.name)


def corpus_root(path: Path) -> str:
    """The `Document.source` of a corpus file, or the folder every source under a corpus
    folder starts with."""
    return str(path.resolve()) if path.is_dir() else file_source(path)
