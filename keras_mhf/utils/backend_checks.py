"""Backend-specific helpers for input checks (the only backend imports of the
layers live here, so `keras_mhf.layers` itself stays on `keras.ops`)."""

import keras


def is_concrete(x):
    """True when `x` holds real values that can be read on the host now.

    False for symbolic tensors: Keras functional inputs, jax tracers under
    `jit`, TensorFlow graph tensors inside `tf.function`, and torch tensors
    while `torch.compile` traces.
    """
    if keras.utils.is_keras_tensor(x):
        return False
    backend = keras.config.backend()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    if backend == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly():
            return False
        return not isinstance(x, tf.Tensor) or hasattr(x, "numpy")
    if backend == "torch":
        import torch

        return not torch.compiler.is_compiling()
    return True
