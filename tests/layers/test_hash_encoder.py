import keras
import numpy as np
import pytest
from keras import ops
from keras_hub.src.tests.test_case import TestCase

from keras_mhf.layers import HashEncoder
from tests.numpy_reference import hash_encoder

SIGNATURES = np.array([[[1, 3, 2], [0, 0, 0], [6, 1, 4]]], dtype="int32")


def weights_of(encoder):
    return dict(
        tables=ops.convert_to_numpy(encoder.stacked_embeddings()),
        w1=ops.convert_to_numpy(encoder.gate_dense.kernel),
        b1=ops.convert_to_numpy(encoder.gate_dense.bias),
        w2=ops.convert_to_numpy(encoder.score_dense.kernel),
        b2=ops.convert_to_numpy(encoder.score_dense.bias),
        ws=ops.convert_to_numpy(encoder.output_dense.kernel),
        bs=ops.convert_to_numpy(encoder.output_dense.bias),
    )


class HashEncoderTest(TestCase):
    def test_layer_behaviors(self):
        self.run_layer_test(
            HashEncoder,
            init_kwargs=dict(
                num_hashes=3, num_buckets=7, hidden_dim=16, gate_dim=8
            ),
            input_data=SIGNATURES,
            expected_output_shape=(1, 3, 16),
            # 3 tables, gate kernel/bias, score kernel/bias, output kernel/bias.
            expected_num_trainable_weights=9,
        )


def test_matches_paper_equations():
    encoder = HashEncoder(3, 7, 16, gate_dim=8)
    encoder.build()
    rng = np.random.default_rng(1)
    for w in encoder.weights:  # non-zero biases so they are exercised too
        w.assign(rng.normal(size=w.shape).astype("float32") * 0.3)
    out = ops.convert_to_numpy(encoder(SIGNATURES))
    assert out.shape == (1, 3, 16)
    np.testing.assert_allclose(
        out, hash_encoder(SIGNATURES, **weights_of(encoder)), atol=1e-5
    )


def test_weights_and_shapes():
    encoder = HashEncoder(3, 7, 16, gate_dim=8)
    encoder.build()
    shapes = sorted(tuple(w.shape) for w in encoder.trainable_weights)
    assert shapes == sorted(
        [(7, 16)] * 3 + [(16, 8), (8,), (8, 1), (1,), (16, 16), (16,)]
    )
    # N(0, 0.02) tables, zero biases.
    assert (
        abs(
            float(np.std(ops.convert_to_numpy(encoder.stacked_embeddings())))
            - 0.02
        )
        < 0.01
    )
    assert not np.any(ops.convert_to_numpy(encoder.output_dense.bias))


@pytest.mark.parametrize(
    "policy", ["mixed_bfloat16", "mixed_float16", "bfloat16"]
)
def test_mixed_precision(policy):
    encoder = HashEncoder(3, 7, 16, gate_dim=8, dtype=policy)
    out = encoder(SIGNATURES)
    assert keras.backend.standardize_dtype(out.dtype) == encoder.compute_dtype
    symbolic = encoder.compute_output_spec(
        keras.KerasTensor((None, 5, 3), "int32")
    )
    assert symbolic.shape == (None, 5, 16)


def test_serialization_round_trip():
    encoder = HashEncoder(3, 7, 16, gate_dim=8, name="enc")
    config = encoder.get_config()
    clone = HashEncoder.from_config(config)
    assert clone.get_config() == config
    restored = keras.layers.deserialize(keras.layers.serialize(encoder))
    assert isinstance(restored, HashEncoder) and restored.gate_dim == 8


def test_tables_are_one_draw_split_over_heads():
    # One variable per head, but the initial values are one [H, B, d] draw.
    initializer = keras.initializers.RandomNormal(stddev=0.02, seed=3)
    encoder = HashEncoder(3, 7, 16, embeddings_initializer=initializer)
    encoder.build()
    expected = keras.initializers.RandomNormal(stddev=0.02, seed=3)((3, 7, 16))
    np.testing.assert_array_equal(
        ops.convert_to_numpy(encoder.stacked_embeddings()),
        ops.convert_to_numpy(expected),
    )
    assert [w.path for w in encoder.embeddings] == [
        f"{encoder.name}/embeddings_{i}" for i in range(3)
    ]
