"""Retrieval on this repository's own docs: word windows against structure-aware passages,
side by side in one run.

Indexes README.md and docs/ as of `--commit` (default: the commit the questions were written
against, bench/data/README.md, so runs compare while the docs change) into two temporary
embedded stores, one with
`retrieval.chunking = "words"` (150-word windows overlapping by 30, the former default) and one
with `"structure"` (headings, paragraphs, whole code blocks and tables, `passage_tokens` word
pieces), and asks the 30 questions of `bench/data/docs_questions.jsonl` with the default hybrid
search. A top-3 passage answers a question when it comes from the question's `file` and at
least half of its words lie in the answering `section` (strict@3), or, more leniently, when
it also may hold at least half of that section's words besides others (hit@3: a 150-word
window holds most short sections whole). `answer@3`: a top-3 passage contains one of the
answers.

Last line: name=value.

    .venv/bin/python -m bench.docs_retrieval [--top-k 3] [--passage-tokens 200]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from selfrag.infra.embeddings.embedder import SentenceEmbedder
from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.jobs.indexing import index_corpus
from selfrag.pipeline.protocols import Passage
from selfrag.schemas.settings import RetrievalSettings

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = REPO / "bench" / "data" / "docs_questions.jsonl"
QUESTIONS_COMMIT = "7195e08"
"""The README and docs the questions were written against (bench/data/README.md)."""
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.+?)\s*#*\s*$")


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def section_words(path: Path) -> tuple[list[str], list[str]]:
    """The file's words, and for each the heading of the section it lies in (fenced code is
    text; a heading's own words belong to its section)."""
    words: list[str] = []
    owners: list[str] = []
    current, in_fence = "", False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        heading = None if in_fence else _HEADING.match(line)
        if heading:
            current = heading.group(2)
        for word in _words(line):
            words.append(word)
            owners.append(current)
    return words, owners


def _locate(passage: list[str], words: list[str]) -> int | None:
    """Where `passage` starts in `words` (its first words matched), or None."""
    head = passage[: min(12, len(passage))]
    if not head:
        return None
    for start in range(len(words) - len(head) + 1):
        if words[start : start + len(head)] == head:
            return start
    return None


def answers(
    passage: Passage, record: dict[str, Any], files: dict[str, Any], strict: bool = False
) -> bool:
    """Whether `passage` is of the record's answering section (see the module docstring);
    `strict`: only when at least half of its own words lie in the section."""
    source = passage.metadata.get("source", "")
    if not source.endswith("/" + record["file"]):  # a path in the snapshot
        return False
    words, owners = files[record["file"]]
    mine = _words(passage.text)
    start = _locate(mine, words)
    if start is None:
        return False
    span = owners[start : start + len(mine)]
    inside = sum(1 for owner in span if owner == record["section"])
    section_size = sum(1 for owner in owners if owner == record["section"])
    if inside * 2 >= len(mine):
        return True
    return not strict and section_size > 0 and inside * 2 >= section_size


def snapshot(commit: str, into: Path) -> Path:
    """README.md and docs/ of `commit`, extracted under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "README.md", "docs"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def run(
    chunking: str,
    records: list[dict[str, Any]],
    top_k: int,
    passage_tokens: int,
    root: Path,
) -> dict[str, float]:
    settings = RetrievalSettings(
        chunking=chunking,  # type: ignore[arg-type]
        passage_tokens=passage_tokens,
    )
    files = {r["file"]: section_words(root / r["file"]) for r in records}
    with tempfile.TemporaryDirectory() as home:
        with QdrantStore.open(settings, Path(home), SentenceEmbedder()) as store:
            started = time.perf_counter()
            for path in (root / "README.md", root / "docs"):
                index_corpus(path, store, progress=False, retrieval=settings)
            seconds = time.perf_counter() - started
            count = store.count()
            results = store.search_many([r["question"] for r in records], top_k)
    pairs = list(zip(records, results, strict=True))
    hit = sum(any(answers(p, r, files) for p in found) for r, found in pairs)
    strict = sum(any(answers(p, r, files, strict=True) for p in found) for r, found in pairs)
    loose = sum(
        any(a.lower() in p.text.lower() for p in found for a in r["answers"]) for r, found in pairs
    )
    return {
        "passages": count,
        "index_s": seconds,
        "hit": hit / len(records),
        "strict": strict / len(records),
        "answer": loose / len(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--passage-tokens", type=int, default=RetrievalSettings().passage_tokens)
    parser.add_argument("--chunking", nargs="+", default=["words", "structure"])
    parser.add_argument("--commit", default=QUESTIONS_COMMIT)
    args = parser.parse_args()
    records = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        root = snapshot(args.commit, Path(tmp))
        rows = {c: run(c, records, args.top_k, args.passage_tokens, root) for c in args.chunking}
    k = args.top_k
    print(
        f"{'chunking':<10} {'passages':>8} {'index s':>8} {f'hit@{k}':>7} {f'strict@{k}':>9}"
        f" {f'answer@{k}':>9}"
    )
    for name, row in rows.items():
        print(
            f"{name:<10} {row['passages']:>8} {row['index_s']:>8.1f} {row['hit']:>7.2f}"
            f" {row['strict']:>9.2f} {row['answer']:>9.2f}"
        )
    gain = rows.get("structure", {}).get("strict", 0.0) - rows.get("words", {}).get("strict", 0.0)
    print(
        " ".join(
            f"{name}_{metric}{k}={rows[name][metric]:.3f}"
            for metric in ("strict", "hit", "answer")
            for name in rows
        )
        + f" strict_gain={gain:+.3f}"
    )


if __name__ == "__main__":
    main()
