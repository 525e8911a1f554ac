#!/usr/bin/env bash
# Set up (if needed) and run a whole Baton deployment on this machine with the default model:
#   ./scripts/serve.sh [baton serve flags...]      e.g. --port 8080 --decode-workers 2
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
exec .venv/bin/baton serve "$@"
