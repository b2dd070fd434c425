#!/usr/bin/env bash
# Install (if needed, with the test tools and the docs generator) and run the whole test suite:
# unit tests and the real model, Qdrant, Redis and Ray tests, the docs site's strict build and
# the built wheel and sdist. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
