"""Derived weights on a node where several processes start at once: one converts, the others
wait for its lock and load its file (`infra.models.model_files.derivation_lock`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selfrag.infra.models.model_files import (
    FTYPE_MOSTLY_F16,
    default_model_path,
    derived_path,
    gguf_file_type,
)
from tests.paths import ROOT

# A child: wait for the common start time, then derive the F16 copy, logging each conversion.
RACER = """
import json, sys, time
from pathlib import Path
from selfrag.infra.models import model_files

home, log, start = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
convert = model_files._quantize

def logged(src, target, ftype):
    with log.open("a") as f:
        f.write(json.dumps({"event": "convert", "t": time.time()}) + "\\n")
    convert(src, target, ftype)
    with log.open("a") as f:
        f.write(json.dumps({"event": "converted", "t": time.time()}) + "\\n")

model_files._quantize = logged
time.sleep(max(0.0, start - time.time()))
path = model_files.derive_weights(model_files.default_model_path(), "f16", home)
with log.open("a") as f:
    f.write(json.dumps({"event": "returned", "t": time.time(), "path": str(path)}) + "\\n")
"""


def test_two_processes_deriving_the_same_weights_convert_once(
    llama_model: Path, tmp_path: Path
) -> None:
    home, log = tmp_path / "home", tmp_path / "events.jsonl"
    # Both children import selfrag first (a second or two), then start together.
    start = time.time() + 8
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(home), str(log), str(start)],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in racers:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.count("convert") == 1, events  # without the lock, both convert
    assert kinds.count("returned") == 2, events
    target = derived_path(default_model_path(), "f16", home)
    assert {e["path"] for e in events if e["event"] == "returned"} == {str(target)}
    # The waiter returned only once the copy was complete, and it is a whole F16 file.
    done = next(e["t"] for e in events if e["event"] == "converted")
    assert all(e["t"] >= done for e in events if e["event"] == "returned"), events
    assert gguf_file_type(target) == FTYPE_MOSTLY_F16
    assert sorted(p.name for p in target.parent.iterdir() if p.name.endswith(".tmp")) == []


def test_a_files_sha256_is_remembered_on_disk_until_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    from selfrag.infra.models import model_files

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(model_files, "_sha_cache", {})
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"GGUF" + b"x" * 1000)
    assert model_files.file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    [record] = (tmp_path / "cache" / "selfrag" / "sha256").iterdir()
    # A later process takes the remembered value without reading the file: shown here by a
    # record that lies (the stamp still matches the file).
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "sha256": "ab" * 32}))
    monkeypatch.setattr(model_files, "_sha_cache", {})
    assert model_files.file_sha256(path) == "ab" * 32
    # Rewritten (another mtime): hashed again.
    path.write_bytes(b"GGUF" + b"y" * 1000)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    monkeypatch.setattr(model_files, "_sha_cache", {})
    assert model_files.file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
