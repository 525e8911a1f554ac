#!/usr/bin/env bash
# Set up (if needed) and run the test suite; extra arguments go to pytest:
#   ./scripts/test.sh                    all tests
#   ./scripts/test.sh tests/test_cli.py -x
# Tests start their own private redis-server; nothing needs to be running.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
# The dashboard test renders /dashboard in headless Chromium (Debian's package).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "==> installing chromium for the dashboard test (apt-get)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium fonts-dejavu-core; } >/dev/null 2>&1 || echo "warning: chromium not installed; the dashboard test will skip" >&2
fi
set +e
# the slowest tests in every run's log: the suite must stay near 15 minutes on 2 cores
.venv/bin/python -m pytest -q --durations=20 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
