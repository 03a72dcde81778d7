"""PyTorch only: `torch.compile` for the hot loops that Keras runs as eager
Python on PyTorch, where JAX and TensorFlow compile them with XLA.

`ops.fori_loop` is a Python loop of eager ops on PyTorch, so each chunk of
the MHF vocabulary scan (`vocabulary_statistics`, Sec. 3.4) wrote and read
its intermediates (H gathers, their sum, max, exp, sum) through memory one
op at a time. Compiled, a chunk is a few fused C++ loops, for one
compilation per process (docs/performance.md has the measurements).
"""

import functools
import warnings

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config


@functools.cache
def compiled(function):
    """`function` under `torch.compile`, once per process: dynamic shapes
    (one program serves every batch and chunk size; a new one only for
    other Python constants or `None`s among the arguments), the whole
    function one graph. If no program can be built (e.g. no C++ compiler
    on the machine), a warning says so and `function` runs eagerly."""
    program = torch.compile(function, dynamic=True, fullgraph=True)
    state = {"run": program}

    def call(*args):
        # Without duck sizing, equal sizes (e.g. 1,024 positions in chunks
        # of 1,024 tokens) are not assumed equal, which would recompile.
        with fx_config.patch(use_duck_shape=False):
            try:
                return state["run"](*args)
            except torch._dynamo.exc.BackendCompilerFailed as error:
                if state["run"] is function:
                    raise
                warnings.warn(
                    f"torch.compile could not build {function.__name__} "
                    f"({type(error.inner_exception).__name__}: "
                    f"{error.inner_exception}); it runs eagerly, slower.",
                    stacklevel=2,
                )
                state["run"] = function
                return function(*args)

    return call
