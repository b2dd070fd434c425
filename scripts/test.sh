#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: unit tests and the real model, Qdrant,
# Redis and Ray tests. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
