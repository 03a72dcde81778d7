"""The inference module (paper Sec. 3.4): token scores, the normalised
distribution and the chunked vocabulary scan against numpy. Candidate
decoding is tested in test_multi_hash_former_decoding.py."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_mhf import SignatureTable
from keras_mhf.models.multi_hash_former import (
    multi_hash_former_inference as inference,
)
from tests.numpy_reference import token_log_probs

TOKENS = ["<pad>"] + [f"tok{i}" for i in range(29)]


def make_table():
    return SignatureTable.from_tokens(TOKENS, 3, 7, pad_token_id=0)


def head(logits):
    return inference.head_log_probs(ops.convert_to_tensor(logits))


def test_token_log_probs_match_numpy_and_sum_to_one():
    table = make_table()
    logits = (
        np.random.default_rng(0).normal(size=(2, 4, 3, 7)).astype("float32")
    )
    out = ops.convert_to_numpy(
        inference.token_log_probs(head(logits), table.signatures)
    )
    assert out.shape == (2, 4, 30) and out.dtype == np.float32
    np.testing.assert_allclose(
        out, token_log_probs(logits, table.signatures), atol=1e-5
    )
    np.testing.assert_allclose(np.exp(out).sum(-1), 1.0, atol=1e-5)
    raw = ops.convert_to_numpy(
        inference.token_scores(head(logits), table.signatures)
    )
    assert np.all(np.exp(raw).sum(-1) <= 1.0 + 1e-5)


def test_token_log_probs_fp32_under_mixed_precision():
    keras.config.set_dtype_policy("mixed_bfloat16")
    table = make_table()
    logits = ops.cast(np.zeros((1, 2, 3, 7)), "bfloat16")
    out = inference.token_log_probs(head(logits), table.signatures)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"


@pytest.mark.parametrize(
    "temperature, compiled", [(1.0, False), (2.5, False), (2.5, True)]
)
def test_chunked_token_statistics_equal_the_full_log_probs(
    temperature, compiled, monkeypatch
):
    """`vocabulary_statistics` (vocabulary in chunks, online log-sum-exp) gives
    the target log-prob, top log-prob and argmax of `token_log_probs`, also
    with each chunk compiled (PyTorch; elsewhere XLA compiles the loop)."""
    vocabulary = 5000  # 20 chunks of 256 tokens, the last one partial
    monkeypatch.setattr(inference, "SCAN_SCORES", 14 * 256)
    if compiled:
        monkeypatch.setattr(inference, "TORCH_COMPILE_CHUNKS", 2)
    tokens = ["<pad>"] + [f"t{i}" for i in range(vocabulary - 1)]
    table = SignatureTable.from_tokens(tokens, 3, 64, pad_token_id=0)
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(2, 7, 3, 64)) * 3).astype("float32")
    targets = rng.integers(0, vocabulary, size=(2, 7))
    raw = ops.convert_to_numpy(
        inference.token_scores(head(logits), table.signatures)
    )
    expected = ops.convert_to_numpy(
        ops.log_softmax(ops.convert_to_tensor(raw / temperature), axis=-1)
    )
    # From the heads' log-probs `[..., H, B]`, and from the cascade's
    # per-head logits `[n, B]`, normalised inside the scan.
    flat = logits.reshape(-1, 3, 64)
    for statistics in (
        inference.vocabulary_statistics(
            head(logits), table.signatures, targets, temperature
        ),
        inference.logit_statistics(
            [ops.convert_to_tensor(flat[:, i]) for i in range(3)],
            table.signatures,
            targets.reshape(-1),
            temperature,
        ),
    ):
        target, best, argmax = (
            np.asarray(ops.convert_to_numpy(x)).reshape(targets.shape)
            for x in statistics
        )
        np.testing.assert_allclose(
            target,
            np.take_along_axis(expected, targets[..., None], -1)[..., 0],
            atol=1e-5,
        )
        np.testing.assert_allclose(best, expected.max(-1), atol=1e-5)
        np.testing.assert_array_equal(argmax, expected.argmax(-1))
