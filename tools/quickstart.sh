#!/usr/bin/env bash
# The README's quickstart: sets up .venv, then trains a small MultiHashFormer and
# its Standard baseline on Python's bundled English documentation, generates,
# evaluates on a held-out slice and exports. Extra arguments go to
# `keras-mhf quickstart` (e.g. --data my_corpus.jsonl --steps 600).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source tools/setup_env.sh
export KERAS_BACKEND="${KERAS_BACKEND:-jax}"
keras-mhf quickstart "$@"
