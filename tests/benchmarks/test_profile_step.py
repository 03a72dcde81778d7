"""`benchmarks.profile_step` runs and attributes a training step's and a
generated token's time to ops (JAX pass)."""

import keras
import pytest

from tests.conftest import run_module


def test_profile_smoke():
    if keras.config.backend() != "jax":
        pytest.skip("benchmarks.profile_step uses the JAX profiler")
    done = run_module("benchmarks.profile_step", "--smoke")
    assert "## training step" in done.stdout and "## generation" in done.stdout
    # Ops are attributed to categories, and the matmuls are found.
    assert "matmul" in done.stdout and "top ops:" in done.stdout
