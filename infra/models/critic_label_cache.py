"""A critic model's support reads on disk, so that `selfrag train --critic` reads each example
once: `$SELFRAG_HOME/critic_labels/<digest of the critic's fingerprint>.jsonl`, one
`{"key": …, "s_sup": …}` line per read example (`pipeline.learning.critic_labels`).

Lines are appended after each batch of reads (`open_lines_for_append`); a line cut short by an
interrupted run, or not a read, is skipped when the file is loaded (that example is read again).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from selfrag.infra.file_lock import open_lines_for_append


def critic_cache_path(home: Path, fingerprint: str) -> Path:
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:24]
    return home / "critic_labels" / f"{digest}.jsonl"


class CriticLabelFile:
    """The `LabelCache` of one critic fingerprint, kept in a JSON-lines file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._values: dict[str, float] = {}
        if path.is_file():
            with path.open(encoding="utf-8", errors="replace") as f:
                for line in f:
                    self._load(line)

    def _load(self, line: str) -> None:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            return
        if not isinstance(row, dict):
            return
        key, value = row.get("key"), row.get("s_sup")
        if isinstance(key, str) and isinstance(value, int | float) and math.isfinite(value):
            self._values[key] = float(value)

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: str) -> float | None:
        return self._values.get(key)

    def put(self, values: dict[str, float]) -> None:
        """Remember `values` and append them to the file."""
        if not values:
            return
        lines = "".join(json.dumps({"key": k, "s_sup": v}) + "\n" for k, v in values.items())
        with open_lines_for_append(self.path) as f:
            f.write(lines)
            f.flush()
        self._values.update(values)
