#!/usr/bin/env bash
# The README's test command: sets up .venv, runs the whole suite once per Keras
# backend (jax, tensorflow, torch), one after another, then the `large` tests
# (minutes-long smoke runs of the benchmarks/ scripts and the recipes) once,
# under JAX.
#   bash tools/test.sh                 # all three backends, then the large step
#   bash tools/test.sh jax -k lookup   # one backend, extra pytest arguments
#   bash tools/test.sh large           # only the large step
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source tools/setup_env.sh
# setup_env.sh sets -e; a failing backend must not stop the others.
set +e
backends=(jax tensorflow torch)
large=1
if [ $# -gt 0 ] && [[ "$1" =~ ^(jax|tensorflow|torch)$ ]]; then
  backends=("$1"); shift; large=0
elif [ $# -gt 0 ] && [ "$1" = large ]; then
  backends=(); shift
fi
# JAX: one persistent compilation cache for the run (tests and the recipes
# they start as subprocesses build the same tiny models again and again;
# identical computations get identical executables, so no number changes).
JAX_CACHE="$(mktemp -d)"
trap 'rm -rf "$JAX_CACHE"' EXIT
export JAX_COMPILATION_CACHE_DIR="$JAX_CACHE/jax"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
# XLA's CPU compiler at optimisation level 0: the suite's models are tiny,
# so compiling them, not running them, is most of a JAX test (the JAX pass
# took 1,025 s at XLA's default level and 790 s at 0 on a 2-core machine).
# Code generation changes, not what is computed: every comparison in the
# suite is of JAX with itself, a numpy reference or another backend, within
# its tolerance. Users' runs (the quickstart included) keep XLA's default.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
# Each backend's pass runs in two pytest-xdist workers, a test module per
# worker (module fixtures are built once): most of a pass is single-threaded
# tracing and compiling of tiny models, so two workers share the 2 cores
# well. MHF_TEST_WORKERS=0 runs a pass in one process. The large step's
# smokes run whole benchmark scripts and recipes in subprocesses (python -m
# benchmarks.NAME, recipes/*.py); two workers overlap the longest
# module (the documented commands) with the others.
workers="${MHF_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then
  # Modules in the order tests/conftest.py sorts them (the longest first),
  # not pytest-xdist's default (the most tests first).
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
status=0
for backend in "${backends[@]}"; do
  echo "=== KERAS_BACKEND=$backend ==="
  KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider \
    "${parallel[@]}" --durations=25 "$@"
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "=== $backend: pytest exited $rc ==="
    status=1
  fi
done
if [ $large -eq 1 ]; then
  echo "=== large tests (KERAS_BACKEND=jax) ==="
  KERAS_BACKEND=jax python -m pytest -q -p no:cacheprovider --run_large \
    "${parallel[@]}" --durations=25 -m large "$@"
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "=== large: pytest exited $rc ==="
    status=1
  fi
fi
exit $status
