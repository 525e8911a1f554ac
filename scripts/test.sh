#!/usr/bin/env bash
# Set up (if needed) and run the test suite; extra arguments go to pytest:
#   ./scripts/test.sh                    all tests
#   ./scripts/test.sh tests/test_cli.py -x
# Tests start their own private redis-server; nothing needs to be running.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
