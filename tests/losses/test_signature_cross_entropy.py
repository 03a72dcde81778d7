import keras
import numpy as np
from keras import ops

from keras_mhf.losses import SignatureCrossEntropy
from tests.numpy_reference import signature_loss


def test_matches_numpy_by_hand():
    # Two heads, three buckets, two positions; the second is masked out.
    logits = np.array(
        [
            [
                [[1.0, 2.0, 0.0], [0.5, 0.5, 3.0]],
                [[9.0, 0.0, 0.0], [0.0, 9.0, 0.0]],
            ]
        ],
        dtype="float32",
    )
    targets = np.array([[[1, 2], [2, 0]]])
    weights = np.array([[1.0, 0.0]])
    # Position 0: CE head 0 = logsumexp(1,2,0) - 2,
    # head 1 = logsumexp(.5,.5,3) - 3.
    by_hand = (np.log(np.exp(1) + np.exp(2) + 1) - 2) + (
        np.log(2 * np.exp(0.5) + np.exp(3)) - 3
    )
    loss = SignatureCrossEntropy()(targets, logits, sample_weight=weights)
    np.testing.assert_allclose(float(loss), by_hand, rtol=1e-6)
    np.testing.assert_allclose(
        by_hand, signature_loss(logits, targets, weights), rtol=1e-6
    )


def test_mean_over_unmasked_positions_and_sum_over_heads():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 4, 11)).astype("float32")
    targets = rng.integers(0, 11, size=(3, 5, 4))
    weights = (rng.random((3, 5)) > 0.3).astype("float32")
    loss = SignatureCrossEntropy()(targets, logits, sample_weight=weights)
    np.testing.assert_allclose(
        float(loss), signature_loss(logits, targets, weights), rtol=1e-5
    )
    unweighted = SignatureCrossEntropy()(targets, logits)
    np.testing.assert_allclose(
        float(unweighted), signature_loss(logits, targets), rtol=1e-5
    )
    # Uniform logits: H * log(B) per position.
    flat = SignatureCrossEntropy()(targets, np.zeros_like(logits))
    np.testing.assert_allclose(float(flat), 4 * np.log(11), rtol=1e-6)


def test_float32_under_bfloat16_logits():
    logits = ops.cast(np.zeros((1, 2, 2, 5)), "bfloat16")
    loss = SignatureCrossEntropy()(np.zeros((1, 2, 2), "int32"), logits)
    assert keras.backend.standardize_dtype(loss.dtype) == "float32"
    np.testing.assert_allclose(float(loss), 2 * np.log(5), rtol=1e-6)


def test_config_round_trip():
    loss = SignatureCrossEntropy(name="sce")
    restored = keras.losses.deserialize(keras.losses.serialize(loss))
    assert isinstance(restored, SignatureCrossEntropy)
    assert restored.get_config() == loss.get_config()
