"""Validation of token ids where they enter a model (host-side, numpy).

The layers never check ids themselves (they stay pure `keras.ops`); the public
entry points of `MultiHashFormerCausalLM` (`fit`, `generate`, `score`) call
`check_token_ids` once per call on concrete arrays, and wrap streamed datasets
with `checked_dataset`, so out-of-range ids fail with one clear message instead
of silently wrong numbers (JAX clamps gathers) or a backend's own error.
"""

import numpy as np


def _to_numpy(values):
    if hasattr(values, "numpy") and not isinstance(values, np.ndarray):
        try:
            return np.asarray(values.numpy())
        except (AttributeError, TypeError, ValueError):
            pass
    from keras import ops

    return np.asarray(ops.convert_to_numpy(values))


def check_token_ids(token_ids, vocabulary_size, what="Token ids"):
    """Raises a clear `ValueError` unless every id is in `[0, vocabulary_size)`.

    Args:
        token_ids: an array-like of ints (numpy, list, or a backend tensor).
        vocabulary_size: int, `V`.
        what: how the message names the ids (e.g. `"Target ids"`).
    """
    ids = _to_numpy(token_ids)
    if ids.size == 0:
        return
    if not np.issubdtype(ids.dtype, np.integer):
        if not np.all(np.isfinite(ids)) or not np.all(ids == np.round(ids)):
            raise ValueError(f"{what} must be integers; got dtype {ids.dtype}.")
    if ids.min() < 0 or ids.max() >= vocabulary_size:
        bad = ids[(ids < 0) | (ids >= vocabulary_size)]
        raise ValueError(
            f"{what} must be in [0, {vocabulary_size - 1}] "
            f"(vocabulary_size={vocabulary_size}); got {bad.size} out-of-range "
            f"id(s), e.g. {bad[:5].tolist()}. Tokenize with the model's own "
            "tokenizer, or expand the vocabulary first "
            "(`MultiHashFormerCausalLM.expand_vocabulary`)."
        )


def check_feature_ids(x, y, vocabulary_size):
    """Checks `x["token_ids"]` (or `x`) and the targets `y` of in-memory
    training data; ignores anything that is not an array of ids (strings,
    datasets)."""
    token_ids = x.get("token_ids") if isinstance(x, dict) else x
    for values, what in ((token_ids, "Token ids"), (y, "Target ids")):
        if values is None or isinstance(values, (str, bytes)):
            continue
        array = (
            np.asarray(values) if isinstance(values, (list, tuple)) else values
        )
        if hasattr(array, "dtype") and hasattr(array, "shape"):
            dtype = np.dtype(
                getattr(array.dtype, "as_numpy_dtype", array.dtype)
            )
            if np.issubdtype(dtype, np.number):
                check_token_ids(array, vocabulary_size, what)


def _check_batch(batch, vocabulary_size):
    """Checks one `(x, y, ...)` or `x` batch; returns it unchanged."""
    if isinstance(batch, tuple):
        check_feature_ids(
            batch[0], batch[1] if len(batch) > 1 else None, vocabulary_size
        )
    else:
        check_feature_ids(batch, None, vocabulary_size)
    return batch


def checked_dataset(dataset, vocabulary_size):
    """Wraps a `tf.data.Dataset` or a Grain dataset of `(x, y, ...)` token-id
    batches so every batch is validated as it is read (the error names the
    out-of-range ids); other objects are returned unchanged.

    The first batch is also checked here, on the host: Keras reads it to
    build the model and reports an error while doing so as "ran out of
    data", which would hide the message.
    """
    import grain

    if isinstance(dataset, (grain.MapDataset, grain.IterDataset)):
        for first in dataset:
            _check_batch(first, vocabulary_size)
            break
        return dataset.map(lambda batch: _check_batch(batch, vocabulary_size))
    if type(dataset).__module__.startswith("tensorflow"):
        for first in dataset.take(1):
            _check_batch(first, vocabulary_size)
        return _checked_tf_dataset(dataset, vocabulary_size)
    return dataset


def _checked_tf_dataset(dataset, vocabulary_size):
    import tensorflow as tf

    def assert_ids(values, what):
        values = tf.cast(values, tf.int64)
        message = (
            f"{what} must be in [0, {vocabulary_size - 1}] "
            f"(vocabulary_size={vocabulary_size}). Tokenize with the model's "
            "own tokenizer, or expand the vocabulary first."
        )
        return [
            tf.debugging.assert_greater_equal(
                values, tf.constant(0, tf.int64), message
            ),
            tf.debugging.assert_less(
                values, tf.constant(vocabulary_size, tf.int64), message
            ),
        ]

    def check(*batch):
        x = batch[0]
        token_ids = x.get("token_ids") if isinstance(x, dict) else x
        checks = []
        if token_ids is not None and token_ids.dtype.is_integer:
            checks += assert_ids(token_ids, "Token ids")
        if (
            len(batch) > 1
            and batch[1] is not None
            and batch[1].dtype.is_integer
        ):
            checks += assert_ids(batch[1], "Target ids")
        with tf.control_dependencies(checks):
            batch = tf.nest.map_structure(tf.identity, batch)
        return batch[0] if len(batch) == 1 else batch

    return dataset.map(check)
