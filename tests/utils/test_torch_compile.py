"""`compiled` (PyTorch's compiled scan chunks, #23): the function's numbers,
one program per process, and an eager fallback with a warning when no
program can be built."""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.config.backend() != "torch", reason="a PyTorch-only module"
)


def scaled_sum(x, scale):
    return keras.ops.sum(keras.ops.exp(x) * scale, axis=0)


def test_compiled_gives_the_function_s_numbers():
    from torch._dynamo.utils import counters

    from keras_mhf.utils.torch_compile import compiled

    assert compiled(scaled_sum) is compiled(scaled_sum)
    rng = np.random.default_rng(0)
    graphs = counters["stats"]["unique_graphs"]
    for rows in (3, 7):  # dynamic shapes: one program for both
        x = keras.ops.convert_to_tensor(rng.normal(size=(rows, 5)), "float32")
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(compiled(scaled_sum)(x, 2.0)),
            keras.ops.convert_to_numpy(scaled_sum(x, 2.0)),
            rtol=1e-6,
        )
    assert counters["stats"]["unique_graphs"] == graphs + 1


def test_a_failed_compilation_warns_and_runs_eagerly(monkeypatch):
    import torch

    from keras_mhf.utils.torch_compile import compiled

    def failing_compile(function, **kwargs):
        def program(*args):
            raise torch._dynamo.exc.BackendCompilerFailed(
                failing_compile, RuntimeError("no C++ compiler"), None
            )

        return program

    def doubled(x):
        return x * 2

    monkeypatch.setattr(torch, "compile", failing_compile)
    x = keras.ops.convert_to_tensor([1.0, 2.0])
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler.*eagerly"):
        np.testing.assert_array_equal(compiled(doubled)(x), [2.0, 4.0])
    np.testing.assert_array_equal(compiled(doubled)(x), [2.0, 4.0])
