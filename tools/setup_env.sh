#!/usr/bin/env bash
# Creates (or reuses) .venv at the repository root and installs keras_mhf with
# all backends and dev tools. Sourced by tools/test.sh and tools/quickstart.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KERAS_MHF_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
STAMP="$VENV/.keras_mhf_installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  # pip's and setuptools' chatter goes to a log; all of it is shown if the
  # install fails.
  LOG="$VENV/install.log"
  echo "Installing keras_mhf and its dependencies into $VENV (log: $LOG)..." >&2
  if ! { python -m pip install -q --upgrade pip &&
    python -m pip install -q -e "$ROOT[all,dev]"; } >"$LOG" 2>&1; then
    cat "$LOG" >&2
    echo "setup_env.sh: the install failed (the log is above and in $LOG)." >&2
    return 1 2>/dev/null || exit 1
  fi
  touch "$STAMP"
fi
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
