"""The disk tier of passage KV states (infra/cache/kv_disk.py): checked files, LRU cap, shared by
processes and kept across restarts; and for real, a restarted engine starting warm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from selfrag.infra.cache import kv_disk
from selfrag.infra.cache.kv_cache import PrefixKey, TieredStateStore
from selfrag.infra.cache.kv_disk import DiskTier
from selfrag.infra.cache.tiers import MemoryLRU
from selfrag.infra.file_lock import FileLock
from tests.suite import SUITE_ENV

TOKENS = b"\x01\x00\x00\x00\x02\x00\x00\x00"
STATE = bytes(range(256)) * 64


def _file(tier: DiskTier, digest: str) -> Path:
    [path] = [p for p in tier.folder.rglob("*.kv") if p.stem == digest]
    return path


def test_a_saved_state_reads_back_as_a_writable_view(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "kv", 1 << 20)
    assert tier.get("ab" * 32, bind=TOKENS) is None
    assert tier.put("ab" * 32, STATE, bind=TOKENS)
    view = tier.get("ab" * 32, bind=TOKENS)
    assert view is not None and bytes(view) == STATE
    assert not view.readonly  # the engine restores from it without a copy
    # Another tier on the same folder (another process, or after a restart) sees it.
    assert bytes(DiskTier(tmp_path / "kv", 1 << 20).get("ab" * 32, bind=TOKENS)) == STATE


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[:-10],  # truncated
        lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]),  # one bit flipped in the state
        lambda raw: b"XXXX" + raw[4:],  # not our format
        lambda raw: raw[:8],  # shorter than the header
    ],
)
def test_a_damaged_file_is_refused_deleted_and_recomputed(tmp_path: Path, damage) -> None:
    tier = DiskTier(tmp_path / "kv", 1 << 20)
    tier.put("cd" * 32, STATE, bind=TOKENS)
    path = _file(tier, "cd" * 32)
    path.write_bytes(damage(path.read_bytes()))
    assert tier.get("cd" * 32, bind=TOKENS) is None
    assert not path.exists() and tier.counters()["disk_rejected"] == 1


def test_a_state_saved_for_other_tokens_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "kv", 1 << 20)
    tier.put("ef" * 32, STATE, bind=TOKENS)
    assert tier.get("ef" * 32, bind=b"\x09\x00\x00\x00") is None
    assert tier.counters()["disk_rejected"] == 1


def test_past_the_cap_the_least_recently_used_go(tmp_path: Path) -> None:
    one = len(STATE) + len(TOKENS) + 64
    tier = DiskTier(tmp_path / "kv", int(3.5 * one))
    for i, name in enumerate(["a1", "b2", "c3"]):
        tier.put(name * 32, STATE, bind=TOKENS)
        os.utime(_file(tier, name * 32), (1000 + i, 1000 + i))
    assert tier.get("a1" * 32, bind=TOKENS) is not None  # read: now the most recent
    tier.put("d4" * 32, STATE, bind=TOKENS)
    names = {p.stem[:2] for p in tier.folder.rglob("*.kv")}
    assert names == {"a1", "c3", "d4"} and tier.counters()["disk_evicted"] == 1
    assert tier.size_bytes() <= tier.max_bytes
    assert not tier.put("e5" * 32, b"x" * (5 * one), bind=TOKENS)  # alone over the cap


def test_the_tiered_store_reads_memory_then_disk_and_writes_behind(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "kv", 1 << 20)
    key = PrefixKey("12" * 32, TOKENS)
    first = TieredStateStore(MemoryLRU(1 << 20), disk=disk)
    first.put(key, STATE)
    first.flush()
    assert first.get(key) == STATE and first.counters()["memory_hit"] == 1
    # A fresh process: nothing in memory, the disk has it (and memory keeps the checked view).
    second = TieredStateStore(MemoryLRU(1 << 20), disk=DiskTier(tmp_path / "kv", 1 << 20))
    assert bytes(second.get(key)) == STATE
    assert bytes(second.get(key)) == STATE
    c = second.counters()
    assert (c["disk_hit"], c["memory_hit"], c["miss"]) == (1, 1, 0)
    first.close()
    second.close()


def test_a_restarted_engine_starts_warm_from_disk(
    llama_model: Path, tmp_path: Path, normans_squad: Path
) -> None:
    """States saved by one process restore in the next; a corrupt one is recomputed, and the
    scores are the same either way."""
    from selfrag.cli import main
    from selfrag.infra.settings_loader import load_settings
    from selfrag.pipeline.critics import Branch
    from selfrag.runtime.system import LocalRuntime

    home = tmp_path / "home"
    env = {"SELFRAG_HOME": str(home), "SELFRAG_MODEL__N_THREADS": "1", **SUITE_ENV}
    settings = load_settings(environ=env)
    corpus = tmp_path / "few.jsonl"
    data = json.loads(normans_squad.read_text())["data"][0]["paragraphs"][:3]
    corpus.write_text(
        "\n".join(json.dumps({"id": f"n{i}", "text": p["context"]}) for i, p in enumerate(data))
    )
    assert main(["--home", str(home), "index", "--no-progress", str(corpus)]) == 0

    def scores() -> tuple[list[float], dict[str, int], float]:
        with LocalRuntime(settings) as rag:
            passages = list(rag.store.passages())
            critic = rag.critic("auto")
            started = time.perf_counter()
            probs = critic.relevance([Branch("Who founded it?", "", p) for p in passages])
            seconds = time.perf_counter() - started
            rag.prefix_store.flush()
            flat = [p.probs[label] for p in probs for label in sorted(p.probs)]
            return flat, dict(rag.kv_store_counters()), seconds

    cold, cold_counts, _ = scores()
    n = len(cold) // 2  # two labels per passage; a long paragraph makes two passages
    assert cold_counts["put"] == n and cold_counts["disk_hit"] == 0
    warm, warm_counts, _ = scores()
    assert warm_counts["disk_hit"] == n and warm_counts["put"] == 0
    assert warm == pytest.approx(cold, abs=1e-4)
    # Damage one file: it is refused and recomputed, never used.
    victim = next((home / "kv").rglob("*.kv"))
    victim.write_bytes(victim.read_bytes()[:-100])
    again, counts, _ = scores()
    assert counts["disk_rejected"] == 1 and counts["put"] == 1 and counts["disk_hit"] == n - 1
    assert again == pytest.approx(cold, abs=1e-4)


def test_index_precompute_kv_fills_the_disk_tier_once(
    llama_model: Path, tmp_path: Path, normans_squad: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from selfrag.cli import main

    home = tmp_path / "home"
    corpus = tmp_path / "few.jsonl"
    # Short paragraphs: one passage each.
    paragraphs = json.loads(normans_squad.read_text())["data"][0]["paragraphs"]
    data = [p for p in paragraphs if len(p["context"].split()) < 100][:4]
    corpus.write_text(
        "\n".join(json.dumps({"id": f"n{i}", "text": p["context"]}) for i, p in enumerate(data))
    )
    base = ["--home", str(home), "index"]
    assert main([*base, "--precompute-kv", str(corpus)]) == 0
    out = capsys.readouterr()
    assert "kv: 4 passage states computed, 0 already saved" in out.out
    assert "MiB for 4 passages" in out.err  # the estimate, after the first batch
    assert len(list((home / "kv").rglob("*.kv"))) == 4
    assert main([*base, "--no-progress", "--precompute-kv"]) == 0  # nothing new to index
    assert "kv: 0 passage states computed, 4 already saved" in capsys.readouterr().out
    assert main([*base]) == 2  # neither paths nor --precompute-kv


def _folder_bytes(folder: Path) -> int:
    """The bytes of every file under `folder` now, as another process would count them."""
    total = 0
    for path in folder.rglob("*"):
        if path.name == ".lock":
            continue
        try:
            if path.is_file():
                total += path.stat().st_size
        except FileNotFoundError:
            pass  # evicted or renamed meanwhile
    return total


_CHILD = """
import os, signal, sys
from pathlib import Path
from selfrag.infra.cache.tiers import MemoryLRU
from selfrag.infra.cache.kv_cache import PrefixKey, TieredStateStore
from selfrag.infra.cache.kv_disk import DiskTier
folder = Path(sys.argv[1])
TOKENS = b"\\x01\\x00\\x00\\x00\\x02\\x00\\x00\\x00"
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_file_truncated_under_a_cached_disk_hit_is_no_sigbus(tmp_path: Path) -> None:
    """Another process truncates the file of a state this one read from disk and keeps in
    memory: using it afterwards must not kill this process (a SIGBUS is exit 135 in a shell,
    returncode -7 here); a fresh reader gets a miss."""
    proc = _run(
        """
        state = bytes(range(256)) * (16 * 1024)  # 4 MiB, many pages
        key = PrefixKey("12" * 32, TOKENS)
        writer = TieredStateStore(None, disk=DiskTier(folder, 1 << 26))
        writer.put(key, state)
        writer.flush()
        reader = TieredStateStore(MemoryLRU(1 << 26), disk=DiskTier(folder, 1 << 26))
        held = reader.get(key)
        [path] = folder.rglob("*.kv")
        os.truncate(path, 0)
        assert bytes(held) == state
        assert bytes(reader.get(key)) == state  # the memory tier's copy
        assert reader.counters()["memory_hit"] == 1
        fresh = TieredStateStore(MemoryLRU(1 << 26), disk=DiskTier(folder, 1 << 26))
        assert fresh.get(key) is None and fresh.counters()["disk_rejected"] == 1
        print("ok")
        """,
        str(tmp_path / "kv"),
    )
    assert proc.returncode != -signal.SIGBUS, "SIGBUS"
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


ONE = 64 * 1024  # one state
FILE = ONE + 52 + len(TOKENS)  # its file: the header (magic, format, lengths, SHA-256), tokens
CAP = 1 << 20


def test_two_tiers_on_one_folder_share_the_cap(tmp_path: Path) -> None:
    first, second = DiskTier(tmp_path / "kv", CAP), DiskTier(tmp_path / "kv", CAP)
    for i in range(40):
        assert (first if i % 2 else second).put(f"{i:064x}", b"s" * ONE, bind=TOKENS)
        assert _folder_bytes(tmp_path / "kv") <= CAP
    assert first.counters()["disk_evicted"] + second.counters()["disk_evicted"] > 0
    assert first.size_bytes() == _folder_bytes(tmp_path / "kv")  # it wrote last
    assert _file(first, f"{39:064x}").stat().st_size == FILE


def test_two_processes_writing_one_folder_stay_within_the_cap(tmp_path: Path) -> None:
    """Measured from outside while both write: at most the cap plus one file per writing
    process (each may write one past the cap before it evicts); the cap once both are done.
    Measured under the folder's lock, so that no eviction runs during a count (a count that
    sees a file, then files written after an eviction, adds up what was never there at once)."""
    folder = tmp_path / "kv"
    code = """
        import time
        tier = DiskTier(folder, int(sys.argv[2]))
        (folder / f"ready-{sys.argv[3]}").touch()
        while not (folder / "go").exists():
            time.sleep(0.005)
        for i in range(80):
            assert tier.put(f"{sys.argv[3]}{i:062x}", b"s" * int(sys.argv[4]), bind=TOKENS)
        """
    args = [str(folder), str(CAP)]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD + textwrap.dedent(code), *args, name, str(ONE)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("aa", "bb")
    ]
    while not all((folder / f"ready-{n}").exists() for n in ("aa", "bb")):
        assert all(c.poll() is None for c in children)
        time.sleep(0.005)
    (folder / "go").touch()
    most, lock = 0, FileLock(folder / ".lock")
    while any(c.poll() is None for c in children):
        with lock:
            most = max(most, _folder_bytes(folder))
        time.sleep(0.001)
    for child in children:
        assert child.wait(timeout=120) == 0, child.stderr.read() if child.stderr else ""
    assert most <= CAP + 2 * FILE, most
    assert _folder_bytes(folder) <= CAP


def test_a_killed_writers_temporary_file_counts_and_is_deleted_once_stale(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    proc = _run(
        """
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed before its rename
        DiskTier(folder, 1 << 20).put("ab" * 32, b"s" * 200_000, bind=TOKENS)
        """,
        str(folder),
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    [temp] = folder.rglob("*.tmp")
    size = temp.stat().st_size
    assert size > 200_000
    tier = DiskTier(folder, 1 << 20)
    assert tier.size_bytes() == size and temp.exists()  # counted; it may be a live writer's
    old = time.time() - 2 * kv_disk.STALE_TEMP_S
    os.utime(temp, (old, old))
    tier.put("cd" * 32, STATE, bind=TOKENS)
    assert tier.evict() == 0
    assert not temp.exists()
    assert tier.size_bytes() == _folder_bytes(folder) == _file(tier, "cd" * 32).stat().st_size
