import keras
import numpy as np
import pytest
from keras import ops

from keras_mhf.layers import CascadeHashDecoder
from keras_mhf.layers import HashEncoder
from tests.numpy_reference import cascade_decoder


def build_pair(num_hashes=3, **kwargs):
    encoder = HashEncoder(num_hashes, 7, 16, gate_dim=8, **kwargs)
    decoder = CascadeHashDecoder(num_hashes, 7, 16, mixer_dim=8, **kwargs)
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


def test_matches_paper_equations():
    encoder, decoder = build_pair()
    hidden = np.random.default_rng(0).normal(size=(2, 5, 16)).astype("float32")
    decoder(hidden, encoder.embeddings)
    rng = np.random.default_rng(2)
    for w in decoder.weights + encoder.weights:
        w.assign(rng.normal(size=w.shape).astype("float32") * 0.3)
    out = ops.convert_to_numpy(decoder(hidden, encoder.embeddings))
    assert out.shape == (2, 5, 3, 7)
    expected = cascade_decoder(
        hidden, ops.convert_to_numpy(encoder.stacked_embeddings()), mixers_of(decoder)
    )
    np.testing.assert_allclose(out, expected, atol=1e-4)


def test_table_forms_and_leading_axes_agree():
    """Per-head tables, one stacked tensor, any leading axes: same logits."""
    encoder, decoder = build_pair()
    hidden = np.random.default_rng(4).normal(size=(2, 3, 5, 16)).astype("float32")
    per_head = ops.convert_to_numpy(decoder(hidden, encoder.embeddings))
    stacked = ops.convert_to_numpy(decoder(hidden, encoder.stacked_embeddings()))
    rows = ops.convert_to_numpy(decoder(hidden.reshape(-1, 16), encoder.embeddings))
    assert per_head.shape == (2, 3, 5, 3, 7)
    np.testing.assert_array_equal(per_head, stacked)
    np.testing.assert_allclose(per_head, rows.reshape(2, 3, 5, 3, 7), atol=1e-6)


def test_mixer_count_and_shapes():
    encoder, decoder = build_pair(num_hashes=4)
    decoder.build()
    shapes = sorted(tuple(w.shape) for w in decoder.trainable_weights)
    assert shapes == sorted([(32, 8), (8,), (8, 16), (16,)] * 3)
    _, single = build_pair(num_hashes=1)
    single.build()
    assert single.trainable_weights == []


def test_gradient_flows_through_soft_cascade():
    """The last head's logits depend on head 0 through s_0 = p_0 E(0): the
    gradient of head 3's loss reaches table 0 only through that path."""
    encoder, decoder = build_pair(num_hashes=2)
    hidden = np.random.default_rng(0).normal(size=(1, 1, 16)).astype("float32")
    decoder(hidden, encoder.embeddings)
    rng = np.random.default_rng(3)
    for w in decoder.weights + encoder.weights:
        w.assign(rng.normal(size=w.shape).astype("float32") * 0.5)
    tables = ops.convert_to_numpy(encoder.stacked_embeddings())

    def last_head(tables_value):
        return ops.sum(decoder(hidden, tables_value)[..., 1, :] ** 2)

    # Finite differences on table 0 (used by the last head only via p_0, s_0).
    delta = np.zeros_like(tables)
    delta[0, 3, 5] = 1e-2
    change = float(last_head(tables + delta)) - float(last_head(tables - delta))
    assert abs(change) > 1e-4
    if keras.config.backend() == "jax":
        import jax

        grad = jax.grad(lambda t: last_head(t))(tables)
        assert np.abs(np.asarray(grad)[0]).sum() > 0
    elif keras.config.backend() == "tensorflow":
        import tensorflow as tf

        t = tf.Variable(tables)
        with tf.GradientTape() as tape:
            value = last_head(t)
        assert np.abs(tape.gradient(value, t).numpy()[0]).sum() > 0
    else:
        import torch

        t = torch.tensor(tables, requires_grad=True)
        last_head(t).backward()
        assert t.grad[0].abs().sum() > 0


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision(policy):
    encoder, decoder = build_pair(dtype=policy)
    hidden = ops.cast(np.ones((1, 2, 16)), encoder.compute_dtype)
    out = decoder(hidden, encoder.embeddings)
    assert keras.backend.standardize_dtype(out.dtype) == decoder.compute_dtype
    assert tuple(out.shape) == (1, 2, 3, 7)


def test_serialization_round_trip():
    _, decoder = build_pair()
    config = decoder.get_config()
    assert CascadeHashDecoder.from_config(config).get_config() == config
