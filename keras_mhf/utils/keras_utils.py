"""Small helpers shared by the layers and models (keras.ops only)."""

import keras
import numpy as np


def normal_initializer(stddev=0.02):
    """N(0, stddev), the authors' initialisation of every table and kernel."""
    return keras.initializers.RandomNormal(stddev=stddev)


def get_initializer(initializer):
    """`"auto"` -> N(0, 0.02); anything else through
    `keras.initializers.get`."""
    if initializer == "auto":
        return normal_initializer()
    return keras.initializers.get(initializer)


def clone_initializer(initializer):
    """A fresh copy, so seeded initializers do not give identical weights."""
    return keras.initializers.get(keras.initializers.serialize(initializer))


def built_dense(
    units, input_dim, name, kernel_initializer, dtype, activation=None
):
    """A built `keras.layers.Dense` with a zero bias and a clone of
    `kernel_initializer` (the paper's mixers, gate and projections)."""
    layer = keras.layers.Dense(
        units,
        activation=activation,
        kernel_initializer=clone_initializer(kernel_initializer),
        dtype=dtype,
        name=name,
    )
    layer.build((None, input_dim))
    return layer


def count_trainable_parameters(model):
    """Number of trainable scalars of a layer or model."""
    return int(sum(np.prod(w.shape) for w in model.trainable_weights))


def copy_weights_by_path(source, target, skip=()):
    """Assigns every variable of `target` the value of the `source` variable
    with the same path, except the variables in `skip`.

    Raises:
        ValueError: a target variable has no source variable with its path,
            or their shapes differ.
    """
    skipped = {id(v) for v in skip}
    by_path = {v.path: v for v in source.weights}
    for variable in target.weights:
        if id(variable) in skipped:
            continue
        origin = by_path.get(variable.path)
        if origin is None or tuple(origin.shape) != tuple(variable.shape):
            found = (
                "missing" if origin is None else f"shape {tuple(origin.shape)}"
            )
            raise ValueError(
                f"Cannot copy weight '{variable.path}' "
                f"{tuple(variable.shape)}: the source model's is {found}."
            )
        variable.assign(origin)
