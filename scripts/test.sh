#!/usr/bin/env bash
# Install (if needed, with the test tools and the docs generator) and run the whole test suite:
# unit tests and the real model, Qdrant, Redis and Ray tests, the docs site's strict build and
# the built wheel and sdist; the 20 slowest tests are listed at the end. Extra arguments go to
# pytest.
#
# --fast (first argument): the fast lane, every test not marked `real`, i.e. none that loads a
# llama.cpp model or starts Redis, Ray, Serve, Chromium or a command that loads a model (the
# marker comes from the fixtures that start them: tests/real.py). The full suite is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
lane=()
if [ "${1:-}" = "--fast" ]; then
    shift
    lane=(-m "not real")
fi
bash scripts/install.sh --dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest --durations=20 ${lane[@]+"${lane[@]}"} "$@"
