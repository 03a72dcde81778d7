import keras
import numpy as np
import pytest
from keras import ops
from keras_hub.src.tests.test_case import TestCase

from keras_mhf.layers import CascadeHashDecoder
from keras_mhf.layers import HashEncoder
from tests.numpy_reference import cascade_decoder


def build_pair(num_hashes=3, **kwargs):
    encoder = HashEncoder(num_hashes, 7, 16, gate_dim=8, **kwargs)
    decoder = CascadeHashDecoder(encoder, mixer_dim=8, **kwargs)
    encoder.build()
    return encoder, decoder


def mixers_of(decoder):
    return [
        tuple(
            ops.convert_to_numpy(v)
            for v in (down.kernel, down.bias, up.kernel, up.bias)
        )
        for down, up in zip(decoder.down_denses, decoder.up_denses)
    ]


def randomize(*layers, seed=2, scale=0.3):
    rng = np.random.default_rng(seed)
    for layer in layers:
        for w in layer.weights:
            w.assign(rng.normal(size=w.shape).astype("float32") * scale)


class CascadeHashDecoderTest(TestCase):
    def test_layer_behaviors(self):
        encoder = HashEncoder(3, 7, 16, gate_dim=8)
        self.run_layer_test(
            CascadeHashDecoder,
            init_kwargs=dict(hash_encoder=encoder, mixer_dim=8),
            input_data=np.random.default_rng(0)
            .normal(size=(2, 5, 16))
            .astype("float32"),
            expected_output_shape=(2, 5, 3, 7),
            # The tied encoder's 9 weights, then 2 mixers x (kernel, bias) x 2.
            expected_num_trainable_weights=9 + 8,
        )


def test_matches_paper_equations():
    encoder, decoder = build_pair()
    hidden = np.random.default_rng(0).normal(size=(2, 5, 16)).astype("float32")
    decoder(hidden)
    randomize(encoder, decoder)
    out = ops.convert_to_numpy(decoder(hidden))
    assert out.shape == (2, 5, 3, 7)
    expected = cascade_decoder(
        hidden,
        ops.convert_to_numpy(encoder.stacked_embeddings()),
        mixers_of(decoder),
    )
    np.testing.assert_allclose(out, expected, atol=1e-4)


def test_leading_axes_agree():
    """Any leading axes give the same logits as one row axis."""
    encoder, decoder = build_pair()
    hidden = (
        np.random.default_rng(4).normal(size=(2, 3, 5, 16)).astype("float32")
    )
    nested = ops.convert_to_numpy(decoder(hidden))
    rows = ops.convert_to_numpy(decoder(hidden.reshape(-1, 16)))
    assert nested.shape == (2, 3, 5, 3, 7)
    np.testing.assert_allclose(nested, rows.reshape(2, 3, 5, 3, 7), atol=1e-6)


def test_tied_to_the_encoder_tables():
    """The decoder owns only the mixers and reads the encoder's variables."""
    encoder, decoder = build_pair(num_hashes=4)
    decoder.build()
    own = [
        w
        for w in decoder.trainable_weights
        if id(w) not in {id(e) for e in encoder.weights}
    ]
    assert sorted(tuple(w.shape) for w in own) == sorted(
        [(32, 8), (8,), (8, 16), (16,)] * 3
    )
    hidden = np.ones((1, 16), "float32")
    before = ops.convert_to_numpy(decoder(hidden))
    encoder.embeddings[0].assign(encoder.embeddings[0] * 2.0)
    assert not np.allclose(ops.convert_to_numpy(decoder(hidden)), before)
    _, single = build_pair(num_hashes=1)
    single.build()
    assert single.down_denses == [] and single.up_denses == []


def test_requires_an_encoder():
    with pytest.raises(ValueError, match="tied to a HashEncoder"):
        CascadeHashDecoder(3)


def test_gradient_flows_through_soft_cascade():
    """The last head's logits depend on head 0's table only through
    s_0 = p_0 E(0): a change of table 0 moves head 1's logits, and its
    gradient reaches table 0."""
    encoder, decoder = build_pair(num_hashes=2)
    hidden = np.random.default_rng(0).normal(size=(1, 1, 16)).astype("float32")
    decoder(hidden)
    randomize(encoder, decoder, seed=3, scale=0.5)
    table = encoder.embeddings[0]
    original = ops.convert_to_numpy(table)

    def last_head():
        return float(ops.sum(decoder(hidden)[..., 1, :] ** 2))

    delta = np.zeros_like(original)
    delta[3, 5] = 1e-2
    table.assign(original + delta)
    up = last_head()
    table.assign(original - delta)
    down = last_head()
    table.assign(original)
    assert abs(up - down) > 1e-4
    if keras.config.backend() == "jax":
        import jax

        def loss(values):
            with keras.StatelessScope(state_mapping=[(table, values)]):
                return ops.sum(decoder(hidden)[..., 1, :] ** 2)

        assert np.abs(np.asarray(jax.grad(loss)(original))).sum() > 0
    elif keras.config.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = ops.sum(decoder(hidden)[..., 1, :] ** 2)
        assert np.abs(tape.gradient(value, table.value).numpy()).sum() > 0
    else:
        value = ops.sum(decoder(hidden)[..., 1, :] ** 2)
        value.backward()
        assert table.value.grad.abs().sum() > 0


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision(policy):
    encoder, decoder = build_pair(dtype=policy)
    hidden = ops.cast(np.ones((1, 2, 16)), encoder.compute_dtype)
    out = decoder(hidden)
    assert keras.backend.standardize_dtype(out.dtype) == decoder.compute_dtype
    assert tuple(out.shape) == (1, 2, 3, 7)


def test_serialization_round_trip():
    _, decoder = build_pair()
    config = decoder.get_config()
    clone = CascadeHashDecoder.from_config(config)
    assert clone.get_config() == config
    assert isinstance(clone.hash_encoder, HashEncoder)
