"""Small helpers shared by the layers (keras.ops only)."""

import keras


def normal_initializer(stddev=0.02):
    """N(0, stddev), the authors' initialisation of every table and kernel."""
    return keras.initializers.RandomNormal(stddev=stddev)


def get_initializer(initializer):
    """`"auto"` -> N(0, 0.02); anything else through `keras.initializers.get`."""
    if initializer == "auto":
        return normal_initializer()
    return keras.initializers.get(initializer)


def clone_initializer(initializer):
    """A fresh copy, so seeded initializers do not give identical weights."""
    return keras.initializers.get(keras.initializers.serialize(initializer))
