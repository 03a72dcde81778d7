"""Small helpers shared by the layers and models (keras.ops only)."""

import contextlib
import inspect
import json
import logging
import os

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


# Keyword arguments that `keras.Model` (functional) takes besides ours.
MODEL_KWARGS = ("name", "trainable")
# ... and what a KerasHub `Task` takes besides them.
TASK_KWARGS = MODEL_KWARGS + ("compile", "dtype")


def argument_names(cls):
    """The named parameters of `cls.__init__`."""
    import inspect

    parameters = inspect.signature(cls.__init__).parameters
    return [
        name
        for name, p in parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def check_known_kwargs(owner, kwargs, known, allowed=MODEL_KWARGS):
    """Refuses keyword arguments that `owner` does not take (Keras'
    functional `Model` would silently ignore them), suggesting the closest
    known name (e.g. `num_hash` -> `num_hashes`)."""
    import difflib

    unknown = sorted(set(kwargs) - set(allowed))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(known), n=1)
        hints.append(
            f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        )
    raise TypeError(
        f"{owner} got unknown argument(s): {', '.join(hints)}. "
        f"Known arguments: {', '.join(sorted(known))}."
    )


def check_temperature(value):
    """A scoring temperature: a finite float > 0 (else a clear error)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"scoring_temperature must be a number; got {value!r}."
        ) from None
    if not np.isfinite(value) or value <= 0:
        raise ValueError(
            f"scoring_temperature must be finite and > 0; got {value}. 1.0 is "
            "the paper's rule; `calibrate` fits a value on held-out text."
        )
    return value


class _DropGrainReadAheadWarning(logging.Filter):
    """Drops Grain's `prefetch_buffer_size=8 is smaller than num_threads=16`
    warning: KerasHub's `fit` on text builds those `grain.ReadOptions`
    itself, so nothing a caller passes can change it."""

    def filter(self, record):
        message = record.getMessage()
        return not (
            message.startswith("prefetch_buffer_size=")
            and "is smaller than num_threads=" in message
        )


def _is_in_memory(x):
    """Data KerasHub's `Task.fit` batches itself into an ordered dataset:
    anything but a dataset, a `keras.utils.PyDataset` or a generator."""
    module = type(x).__module__
    if x is None or module.startswith(("grain", "tensorflow.python.data")):
        return False
    if isinstance(x, keras.utils.PyDataset) or inspect.isgenerator(x):
        return False
    return True


@contextlib.contextmanager
def in_memory_fit(x, args, kwargs):
    """Around a KerasHub task's `fit` on in-memory data (strings, arrays, a
    dict of arrays): states the order the data really has and keeps
    KerasHub's own Grain options quiet.

    KerasHub 0.32 batches in-memory data into an ordered Grain dataset, and
    Keras ignores `shuffle` for a dataset (warning that it does, on every
    call, since `shuffle=True` is `fit`'s default). When the caller did not
    pass `shuffle`, `shuffle=False` is set in `kwargs` (the training is the
    same; shuffle the data first to train in another order); a
    `shuffle=True` the caller passed still warns, as it should. Grain's
    warning about the read-ahead buffer KerasHub chose is dropped while the
    block runs.

    Args:
        x: `fit`'s `x`.
        args: `fit`'s positional arguments after `x` and `y`.
        kwargs: `fit`'s keyword arguments (changed in place).

    Example:

    ```python
    with in_memory_fit(x, args, kwargs):
        history = super().fit(x, y, *args, **kwargs)
    ```
    """
    if not _is_in_memory(x):
        yield
        return
    if len(args) < 7:  # `shuffle` is fit's 9th parameter (x, y, ...)
        kwargs.setdefault("shuffle", False)
    absl_logger = logging.getLogger("absl")
    quiet = _DropGrainReadAheadWarning()
    absl_logger.addFilter(quiet)
    try:
        yield
    finally:
        absl_logger.removeFilter(quiet)


def tensorflow_executing_eagerly():
    """True under the TensorFlow backend outside `tf.function` (eager
    training, `run_eagerly=True`); False on other backends."""
    if keras.config.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return tf.executing_eagerly()


def rematerialized(variables, function):
    """`function(*tensors)` under `keras.remat` (gradient checkpointing):
    the backward pass recomputes its intermediates instead of keeping them.

    The `variables` `function` reads (a layer's weights) enter the
    rematerialised call as arguments and are mapped back by a
    `keras.StatelessScope`: TensorFlow's `recompute_grad` cannot capture
    variables inside a while loop, and JAX's and TensorFlow's remat take
    tensors only (Keras' `RematScope` would pass a layer's `training=` and
    `None` arguments through them and fail). `function` must not update
    variables (no dropout, no seed state). In eager TensorFlow (a
    `GradientTape` outside `tf.function`, e.g. `run_eagerly=True`)
    `recompute_grad` would count the variables' gradient twice (through
    the arguments and as variables it saw read): there `function` runs
    plain, which is exact.

    Returns:
        A function of the same tensors as `function`, reading the
        variables' values as they are now (call it where `function` would be
        called, e.g. inside a layer's `call`).
    """
    if tensorflow_executing_eagerly():
        return function
    variables = list(variables)

    @keras.remat
    def call(values, *tensors):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            return function(*tensors)

    if keras.config.backend() == "torch":
        from keras_mhf.utils.torch_checkpointing import without_early_stop

        call = without_early_stop(call)
    values = [keras.ops.convert_to_tensor(v) for v in variables]
    return lambda *tensors: call(values, *tensors)


def memory_lean(optimizer):
    """`optimizer`, updating its variables with small temporaries: on
    PyTorch in groups (`keras_mhf.utils.torch_optimizers`; Keras' update
    copies all the parameters several times over), elsewhere as it is (XLA
    fuses the update). The same weights either way; a loss-scale
    optimizer's inner optimizer is the one changed. Returns `optimizer`."""
    outer, optimizer = (
        optimizer,
        getattr(optimizer, "inner_optimizer", optimizer),
    )
    if keras.config.backend() == "torch" and optimizer is not None:
        from keras_mhf.utils.torch_optimizers import update_in_groups

        update_in_groups(optimizer)
    return outer


def dense_layout(x):
    """`x` stored densely in its own axis order. PyTorch's `transpose` is a
    strided view, so gathering rows of a transposed tensor reads memory with
    a stride, which slows the vocabulary scan's gathers; XLA
    (JAX, TensorFlow) chooses layouts itself, so `x` is returned as is."""
    if keras.config.backend() == "torch":
        return x.contiguous()
    return x


def preset_dtype(serialized):
    """A backbone config's serialized `dtype`, as a preset can load it back.

    KerasHub's preset loader casts any saved policy whose name is not a
    plain float dtype to... nothing: `mixed_bfloat16` fails in its
    `_resolve_dtype` ("Invalid dtype"). A policy map is passed through as
    saved, so a mixed policy is saved as a `DTypePolicyMap` with no entries
    whose default is that policy; `model_dtype` turns it back."""
    if not isinstance(serialized, dict):
        return serialized
    name = (serialized.get("config") or {}).get("name")
    if serialized.get("class_name") != "DTypePolicy" or not name:
        return serialized
    policy = keras.dtype_policies.get(name)
    if policy.compute_dtype == policy.variable_dtype:
        return serialized
    return keras.dtype_policies.serialize(
        keras.dtype_policies.DTypePolicyMap(default_policy=name)
    )


def keep_saved_precision(preset, kwargs):
    """`from_preset`'s `kwargs` with `dtype` set to the precision a local
    preset was saved in, unless the caller chose one.

    KerasHub casts a preset saved under a plain float policy (e.g.
    "bfloat16") to Keras' current policy, so a bfloat16 run's preset would
    reload in float32 (twice the memory, other numbers). keras_mhf's models
    load in the saved precision; `dtype=`, or a global policy set with
    `keras.config.set_dtype_policy`, still chooses another. Policies that
    are not a plain float (mixed, quantized) KerasHub keeps as saved."""
    chosen = keras.config.dtype_policy().name != "float32"
    if kwargs.get("dtype") is not None or chosen:
        return kwargs
    path = os.path.join(str(preset), "config.json")
    if not os.path.isfile(path):
        return kwargs
    try:
        with open(path, encoding="utf-8") as f:
            saved = (json.load(f).get("config") or {}).get("dtype")
    except (OSError, ValueError, AttributeError):
        return kwargs  # the loader reports an unreadable config.json
    if isinstance(saved, dict) and saved.get("class_name") == "DTypePolicy":
        name = (saved.get("config") or {}).get("name")
        if name in ("float16", "bfloat16", "float32", "float64"):
            return dict(kwargs, dtype=name)
    return kwargs


def model_dtype(dtype):
    """A backbone's `dtype` argument with a `preset_dtype` policy map (no
    entries) turned back into its policy; anything else as given."""
    if isinstance(dtype, dict) and dtype.get("class_name") == "DTypePolicyMap":
        config = dtype.get("config") or {}
        if not config.get("policy_map"):
            return config.get("default_policy")
    if isinstance(dtype, keras.dtype_policies.DTypePolicyMap) and not len(
        dtype
    ):
        return dtype.default_policy.name
    return dtype
