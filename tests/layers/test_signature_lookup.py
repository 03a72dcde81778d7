import keras
import numpy as np
import pytest
from keras import ops
from keras_hub.src.tests.test_case import TestCase

from keras_mhf import SignatureTable
from keras_mhf.layers import SignatureLookup

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
            expected_num_non_trainable_weights=1,  # the table only
            expected_num_non_trainable_variables=1,
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
