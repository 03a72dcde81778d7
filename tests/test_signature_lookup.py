import keras
import numpy as np
import pytest
from keras import ops
from keras_hub.src.tests.test_case import TestCase

from keras_mhf import SignatureTable
from keras_mhf.layers import SignatureLookup
from tests.numpy_reference import token_log_probs

TOKENS = ["<pad>"] + [f"tok{i}" for i in range(29)]


def make_lookup(**kwargs):
    table = SignatureTable.from_tokens(TOKENS, 3, 7, pad_token_id=0)
    return table, SignatureLookup(30, 3, 7, 0, signatures=table, **kwargs)


class SignatureLookupTest(TestCase):
    def test_layer_behaviors(self):
        table, _ = make_lookup()
        ids = np.array([[1, 5, 0], [29, 2, 3]], "int32")
        self.run_layer_test(
            SignatureLookup,
            # The layer outputs int32 signatures, so its own dtype is int32
            # here (in a model it carries the model's policy).
            init_kwargs=dict(
                vocabulary_size=30,
                num_hashes=3,
                num_buckets=7,
                pad_token_id=0,
                signatures=table,
                dtype="int32",
            ),
            input_data=ids,
            expected_output_shape=(2, 3, 3),
            expected_output_data=table.signatures[ids],
            # The table and, per head, the inverted index (tokens, starts).
            expected_num_non_trainable_weights=1 + 2 * 3,
            expected_num_non_trainable_variables=1 + 2 * 3,
            run_training_check=False,  # nothing to train
        )


def test_call_is_pure_keras_ops():
    """No host round-trip: the layer traces under a compiled function."""
    table, lookup = make_lookup()
    inputs = keras.Input((None,), dtype="int32")
    model = keras.Model(inputs, lookup(inputs))
    ids = np.array([[1, 5, 0]], "int32")
    np.testing.assert_array_equal(
        ops.convert_to_numpy(model.predict(ids, verbose=0)),
        table.signatures[ids],
    )


def test_ids_to_signatures():
    table, lookup = make_lookup()
    ids = np.array([[1, 5, 0], [29, 2, 3]])
    out = lookup(ids)
    assert keras.backend.standardize_dtype(out.dtype) == "int32"
    np.testing.assert_array_equal(
        ops.convert_to_numpy(out), table.signatures[ids]
    )
    assert lookup.signatures.trainable is False
    assert len(lookup.trainable_weights) == 0


def test_token_log_probs_match_numpy_and_sum_to_one():
    table, lookup = make_lookup()
    logits = (
        np.random.default_rng(0).normal(size=(2, 4, 3, 7)).astype("float32")
    )
    out = ops.convert_to_numpy(lookup.token_log_probs(logits))
    assert out.shape == (2, 4, 30) and out.dtype == np.float32
    np.testing.assert_allclose(
        out, token_log_probs(logits, table.signatures), atol=1e-5
    )
    np.testing.assert_allclose(np.exp(out).sum(-1), 1.0, atol=1e-5)
    raw = ops.convert_to_numpy(lookup.token_log_probs(logits, normalize=False))
    assert np.all(np.exp(raw).sum(-1) <= 1.0 + 1e-5)


def test_token_log_probs_fp32_under_mixed_precision():
    keras.config.set_dtype_policy("mixed_bfloat16")
    _, lookup = make_lookup()
    logits = ops.cast(np.zeros((1, 2, 3, 7)), "bfloat16")
    out = lookup.token_log_probs(logits)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"


def test_bad_tables_are_refused():
    table = SignatureTable.from_tokens(TOKENS, 3, 7, pad_token_id=0)
    with pytest.raises(ValueError, match="shape"):
        SignatureLookup(31, 3, 7, signatures=table)
    with pytest.raises(ValueError, match="num_buckets"):
        SignatureLookup(30, 3, 8, signatures=table)


def test_serialization_round_trip(tmp_path):
    table, lookup = make_lookup(name="lookup")
    config = lookup.get_config()
    assert config["signatures"] is None
    clone = SignatureLookup.from_config(config)
    assert clone.get_config() == config
    inputs = keras.Input((None,), dtype="int32")
    model = keras.Model(inputs, lookup(inputs))
    path = str(tmp_path / "lookup.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    ids = np.array([[3, 4, 5]])
    np.testing.assert_array_equal(
        ops.convert_to_numpy(restored(ids)), table.signatures[ids]
    )


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_chunked_token_statistics_equal_the_full_log_probs(temperature):
    """`token_statistics` (vocabulary in chunks, online log-sum-exp) gives
    the target log-prob, top log-prob and argmax of `token_log_probs`."""
    vocabulary = 5000  # several chunks, the last one partial
    tokens = ["<pad>"] + [f"t{i}" for i in range(vocabulary - 1)]
    table = SignatureTable.from_tokens(tokens, 3, 64, pad_token_id=0)
    lookup = SignatureLookup(vocabulary, 3, 64, 0, signatures=table)
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(2, 7, 3, 64)) * 3).astype("float32")
    targets = rng.integers(0, vocabulary, size=(2, 7))
    raw = ops.convert_to_numpy(lookup.token_log_probs(logits, normalize=False))
    expected = ops.convert_to_numpy(
        ops.log_softmax(ops.convert_to_tensor(raw / temperature), axis=-1)
    )
    target, best, argmax = (
        np.asarray(ops.convert_to_numpy(x))
        for x in lookup.token_statistics(logits, targets, temperature)
    )
    np.testing.assert_allclose(
        target,
        np.take_along_axis(expected, targets[..., None], -1)[..., 0],
        atol=1e-5,
    )
    np.testing.assert_allclose(best, expected.max(-1), atol=1e-5)
    np.testing.assert_array_equal(argmax, expected.argmax(-1))
