#!/usr/bin/env bash
# Install (if needed, with the test tools and the docs generator) and run the whole test suite:
# unit tests and the real model, Qdrant, Redis and Ray tests, the docs site's strict build and
# the built wheel and sdist; each lane's 20 slowest tests are listed at the end.
#
# The whole suite runs as two pytest lanes at once: the tests marked `real` (those that load a
# llama.cpp model or start Redis, Ray, Serve, Chromium or a command that loads a model; the
# marker comes from the fixtures that start them: tests/real.py) with those marked `deadline`
# (sub-second deadlines raced against threads, which a starved process would miss), and
# beside them, at the lowest CPU priority, every other test. The real lane spends much of its
# time waiting on the processes it starts; the other lane uses that idle CPU and yields it at
# once when the real lane wants it. The other lane's output follows the real lane's; the exit
# status is non-zero if either lane failed.
#
# --fast (first argument): the fast lane alone, every test not marked `real`, for your own
# loop. Other arguments go to one pytest run of their own (both lanes' tests in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
    shift
    fast=1
fi
bash scripts/install.sh --dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
pytest=(.venv/bin/python -m pytest --durations=20)
if [ "$fast" = 1 ]; then
    exec "${pytest[@]}" -m "not real" "$@"
fi
if [ "$#" -gt 0 ]; then
    exec "${pytest[@]}" "$@"
fi

other_log=$(mktemp /tmp/selfrag-tests-other.XXXXXX.log)
nice -n 19 "${pytest[@]}" -m "not real and not deadline" >"$other_log" 2>&1 &
other=$!
stop_other() {
    # Only the lane started here, if it is still running (an interrupted run).
    kill "$other" 2>/dev/null || true
    rm -f "$other_log"
}
trap stop_other EXIT
status=0
"${pytest[@]}" -m "real or deadline" || status=$?
wait "$other" || status=$((status ? status : $?))
echo
echo "=== the other tests (run beside the real ones, at the lowest CPU priority) ==="
cat "$other_log"
exit "$status"
