#!/usr/bin/env bash
# The README's test command: sets up .venv, then runs the whole suite once per
# Keras backend (jax, tensorflow, torch), one after another.
#   bash tools/test.sh            # all three backends
#   bash tools/test.sh jax -k lookup   # one backend, extra pytest arguments
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source tools/setup_env.sh
# setup_env.sh sets -e; a failing backend must not stop the others.
set +e
backends=(jax tensorflow torch)
if [ $# -gt 0 ] && [[ "$1" =~ ^(jax|tensorflow|torch)$ ]]; then
  backends=("$1"); shift
fi
status=0
for backend in "${backends[@]}"; do
  echo "=== KERAS_BACKEND=$backend ==="
  KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider "$@"
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "=== $backend: pytest exited $rc ==="
    status=1
  fi
done
exit $status
