"""What the test suite runs on: SmolLM2-135M, for speed (the default preset has its own
real-model tests). `tests/conftest.py` puts it into the session's environment; a test that
loads settings from an environment of its own adds `SUITE_ENV`. And what the session's shared
fixtures of tests/conftest.py give (`TrainedHeads`)."""

from dataclasses import dataclass
from pathlib import Path

SUITE_ENV = {
    "SELFRAG_MODEL__PRESET": "smollm2",
    # `selfrag ask` would calibrate first (minutes); tests that want it turn it on.
    "SELFRAG_MODEL__CALIBRATE_ON_FIRST_USE": "false",
}


@dataclass(frozen=True)
class TrainedHeads:
    """One `selfrag train` run: the home it trained on, the heads file and what it printed."""

    home: Path
    path: Path
    printed: str
