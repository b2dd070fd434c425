"""infra/corpus/safe_files.py: which files of a folder are read (links out, special files and
pseudo filesystems passed over with their reason) and reads bounded whatever a file claims."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from selfrag.infra.corpus.safe_files import (
    Passed,
    corpus_root,
    file_source,
    folder_files,
    is_pseudo,
    read_bounded,
)

SUFFIXES = frozenset({".md", ".txt"})


def _names(items: list[Path | Passed], root: Path) -> list[str]:
    return [
        f"passed:{Path(i.path).relative_to(root)}"
        if isinstance(i, Passed)
        else str(i.relative_to(root))
        for i in items
    ]


def test_a_folder_gives_its_files_sorted_and_each_one_passed_over_with_its_reason(
    tmp_path: Path,
):
    corpus, outside = tmp_path / "corpus", tmp_path / "outside"
    (corpus / "sub").mkdir(parents=True)
    outside.mkdir()
    (corpus / "b.md").write_text("b")
    (corpus / "a.txt").write_text("a")
    (corpus / "sub" / "c.md").write_text("c")
    (corpus / "image.png").write_bytes(b"\x89PNG")
    (corpus / ".hidden.md").write_text("editor state")
    (outside / "secret.md").write_text("secret")
    (corpus / "out.md").symlink_to(outside / "secret.md")
    (corpus / "in.md").symlink_to(corpus / "a.txt")
    (corpus / "loop").symlink_to(corpus)

    items = list(folder_files(corpus, follow_links=False, suffixes=SUFFIXES))

    assert _names(items, corpus) == [
        "a.txt",
        "b.md",
        "passed:image.png",
        "passed:out.md",
        "sub/c.md",
    ]
    passed = {Path(i.path).name: i.reason for i in items if isinstance(i, Passed)}
    assert passed["image.png"].startswith("not a format selfrag reads (.md/.txt)")
    assert "outside the folder: not followed (--follow-links reads it)" in passed["out.md"]


def test_follow_links_reads_a_link_out_of_the_folder_but_never_one_into_proc(tmp_path: Path):
    corpus, outside = tmp_path / "corpus", tmp_path / "outside"
    corpus.mkdir()
    outside.mkdir()
    (outside / "secret.md").write_text("shared")
    (corpus / "out.md").symlink_to(outside / "secret.md")
    (corpus / "environ.txt").symlink_to("/proc/self/environ")

    items = list(folder_files(corpus, follow_links=True, suffixes=SUFFIXES))

    assert corpus / "out.md" in items
    [proc] = [i for i in items if isinstance(i, Passed)]
    assert proc.path == str(corpus / "environ.txt")
    assert "a pseudo filesystem: not followed" in proc.reason


def test_a_bounded_read_gives_the_bytes_up_to_the_limit_and_refuses_past_it(tmp_path: Path):
    path = tmp_path / "doc.txt"
    path.write_bytes(b"x" * 10)
    assert read_bounded(path, 10) == b"x" * 10
    refused = read_bounded(path, 9)
    assert refused == "document too large (10 bytes, limit 9; retrieval.max_document_bytes)"


def test_special_files_and_pseudo_filesystems_are_never_read(tmp_path: Path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    # Opened without blocking: a FIFO with no writer would hang a plain open.
    assert read_bounded(fifo, 100) == "not a regular file (a FIFO, device or socket): never read"
    assert "pseudo filesystem" in str(read_bounded(Path("/proc/self/environ"), 100))
    assert str(read_bounded(tmp_path / "missing.txt", 100)).startswith("cannot open (")


@pytest.mark.parametrize(
    ("path", "pseudo"),
    [("/proc", True), ("/sys/kernel", True), ("/dev/null", True), ("/procedures", False)],
)
def test_pseudo_filesystems_are_told_by_their_root(path: str, pseudo: bool):
    assert is_pseudo(Path(path)) is pseudo


def test_a_source_resolves_the_folders_but_not_the_file(tmp_path: Path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    (real / "doc.md").write_text("d")
    (real / "link.md").symlink_to(real / "doc.md")
    assert file_source(tmp_path / "alias" / "link.md") == str(real.resolve() / "link.md")
    assert corpus_root(tmp_path / "alias") == str(real.resolve())
    assert corpus_root(tmp_path / "alias" / "doc.md") == str(real.resolve() / "doc.md")
