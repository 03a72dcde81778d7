#!/usr/bin/env bash
# The accelerator run-book in one command: on a GPU or TPU machine, installs
# what is missing and measures MHF against Standard at the paper's 100M shape
# (training at V = 32K and 256K, sequence 1024, the largest batch that fits;
# decoding at V = 32K and 1M), writing accelerator_check.{json,md} to
# --output (default benchmarks/results). See docs/scaling.md#accelerators.
#
#   bash benchmarks/accelerator_check.sh                  # JAX on the accelerator
#   KERAS_BACKEND=torch bash benchmarks/accelerator_check.sh  # PyTorch (CUDA)
#   bash benchmarks/accelerator_check.sh --smoke --output /tmp/check  # CPU, tiny
#
# Installing: the packages keras_mhf needs beyond the machine's JAX/PyTorch
# (keras, keras-hub, mmh3, ...) come from wheels in .whl/ when that folder
# exists (machines without a package index: download them elsewhere with
# `pip download --no-deps ... -d .whl`), else from the index (pip install -e .).
set -euo pipefail
cd "$(dirname "$0")/.."
export KERAS_BACKEND="${KERAS_BACKEND:-jax}"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import keras, keras_hub, mmh3" 2>/dev/null; then
    if [ -d .whl ]; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target /tmp/keras_mhf_site .whl/*.whl
        export PYTHONPATH="/tmp/keras_mhf_site${PYTHONPATH:+:$PYTHONPATH}"
    else
        "$PYTHON" -m pip install -q -e .
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import keras; print('keras', keras.__version__, 'backend', keras.config.backend())"
exec "$PYTHON" -m benchmarks.accelerator_check "$@"
