"""Where the tests find the repository, wherever a test file sits under tests/."""

from __future__ import annotations

from pathlib import Path

# The repository's root: the installed package's own folder in a checkout.
ROOT = Path(__file__).resolve().parents[1]
