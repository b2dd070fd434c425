#!/usr/bin/env bash
# Audit the exact installed dependency set (`pip freeze` of .venv, the lock this project runs
# on) for known vulnerabilities with pip-audit against the OSV database.
# Vulnerabilities found: exit 1. Vulnerability service unreachable (offline CI, sandbox): say
# so loudly and exit 0, so CI never fails for lack of network; the audit then did NOT run.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import pip_audit" 2>/dev/null; then
    .venv/bin/python -m pip install -q pip-audit || {
        echo "audit: SKIPPED - pip-audit could not be installed (no package index?)" >&2
        exit 0
    }
fi
# Any HTTP answer (even an error status) means the service is reachable; only a network
# failure (no DNS, no route) skips the audit.
if ! .venv/bin/python -c "
import urllib.error, urllib.request
try:
    urllib.request.urlopen('https://api.osv.dev/v1/query', data=b'{}', timeout=10)
except urllib.error.HTTPError:
    pass
" 2>/dev/null; then
    echo "audit: SKIPPED - api.osv.dev is unreachable from here; dependencies NOT audited" >&2
    exit 0
fi
LOCK=$(mktemp /tmp/selfrag-audit.XXXXXX.txt)
trap 'rm -f "$LOCK"' EXIT
.venv/bin/python -m pip freeze --exclude-editable | grep -v '^-e ' > "$LOCK"
# --no-deps: the freeze is already the full resolved set.
.venv/bin/pip-audit -r "$LOCK" --no-deps --disable-pip -s osv --progress-spinner off
