"""The fused, chunked cascade head (#23): the same loss and gradients as the
unchunked head (the reference, `head_block_size=0`), from the hidden states
block by block."""

import csv
import os

import keras
import numpy as np
import pytest
from keras import ops

from keras_mhf.losses import SignatureCrossEntropy
from keras_mhf.losses import fused_signature_loss as fused_loss
from keras_mhf.models import MultiHashFormerCausalLM

TOKENS = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]


def build(seed=0, **kwargs):
    keras.utils.set_random_seed(seed)
    lm = MultiHashFormerCausalLM.from_tokens(
        TOKENS,
        "tiny_h3b64",
        pad_token_id=0,
        gate_dim=8,
        mixer_dim=8,
        **kwargs,
    )
    lm.compile(optimizer=keras.optimizers.SGD(0.1))
    return lm


def batch(seed=0, rows=3, length=7):
    """21 positions (no block size below divides it), a ragged mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 64, (rows, length + 1)).astype("int32")
    x = {
        "token_ids": ids[:, :-1],
        "padding_mask": np.ones((rows, length), "int32"),
    }
    weights = (rng.random((rows, length)) > 0.3).astype("float32")
    return x, ids[:, 1:], weights


@pytest.fixture(scope="module")
def lm():
    return build()


def loss_and_gradients(lm, x, y, sample_weight):
    """The task's own training loss (`call(training=True)` +
    `compute_loss`) and its gradient for every trainable variable."""
    variables = lm.trainable_variables
    backend = keras.config.backend()
    if backend == "jax":
        import jax

        non_trainable = [v.value for v in lm.non_trainable_variables]
        metrics = [v.value for v in lm.metrics_variables]

        def f(trainable):
            y_pred, _, _ = lm.stateless_call(
                trainable, non_trainable, x, training=True, return_losses=True
            )
            loss, _ = lm.stateless_compute_loss(
                trainable,
                non_trainable,
                metrics,
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=True,
            )
            return loss

        loss, grads = jax.jit(jax.value_and_grad(f))(
            [v.value for v in variables]
        )
    elif backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y_pred = lm(x, training=True)
            loss = lm.compute_loss(x, y, y_pred, sample_weight)
        grads = tape.gradient(loss, [v.value for v in variables])
    else:
        import torch

        y_pred = lm(x, training=True)
        loss = lm.compute_loss(x, y, y_pred, sample_weight)
        grads = torch.autograd.grad(loss, [v.value for v in variables])
    lm.step_signatures.clear()  # as `compute_metrics` does after a step
    return float(ops.convert_to_numpy(loss)), [
        np.asarray(ops.convert_to_numpy(g), "float64") for g in grads
    ]


def assert_gradients_close(grads, ref_grads, rtol):
    """Each gradient within `rtol` of its own largest entry; a gradient
    below 1e-3 of the largest of all is held to `rtol` x that 1e-3 (an
    absolute 1e-8 of the largest at `rtol=1e-5`): the hash encoder's score
    bias has a gradient that is zero in exact arithmetic (a shift of softmax
    scores), and float32 rounding alone sets its value in both heads."""
    floor = 1e-3 * max(np.abs(ref).max() for ref in ref_grads)
    for g, ref in zip(grads, ref_grads):
        scale = max(np.abs(ref).max(), floor)
        assert np.abs(g - ref).max() <= rtol * scale


@pytest.mark.parametrize(
    "block_size, weighted", [(5, True), (4, False), (None, True)]
)
def test_loss_and_every_gradient_equal_the_unchunked_head(
    lm, block_size, weighted
):
    x, y, weights = batch()
    weights = weights if weighted else None
    lm.head_block_size = 0
    ref_loss, ref_grads = loss_and_gradients(lm, x, y, weights)
    lm.head_block_size = block_size
    try:
        assert len(lm(x, training=True).shape) == 3  # hidden states
        loss, grads = loss_and_gradients(lm, x, y, weights)
    finally:
        lm.head_block_size = None
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert len(grads) == len(ref_grads) == len(lm.trainable_variables)
    assert_gradients_close(grads, ref_grads, 1e-5)


def test_fused_loss_is_signature_cross_entropy(lm):
    x, y, weights = batch(seed=1)
    hidden = lm.backbone(x)
    signatures = lm.backbone.signature_lookup(y)
    expected = SignatureCrossEntropy()(
        signatures, lm.hash_decoder(hidden), weights
    )
    for block_size in (2, 8, 1000):
        value = fused_loss.fused_signature_loss(
            lm.hash_decoder, hidden, signatures, weights, block_size
        )
        np.testing.assert_allclose(
            ops.convert_to_numpy(value),
            ops.convert_to_numpy(expected),
            rtol=1e-6,
        )


def test_a_fit_step_gives_the_same_weights():
    x, y, weights = batch(seed=2, rows=4)
    results = []
    for block_size in (0, 5):
        lm = build(seed=3, head_block_size=block_size)
        history = lm.fit(
            x, y, sample_weight=weights, batch_size=4, epochs=2, verbose=0
        ).history["loss"]
        results.append((history, [ops.convert_to_numpy(v) for v in lm.weights]))
    (ref_history, ref_weights), (history, weights) = results
    np.testing.assert_allclose(history, ref_history, rtol=1e-5)
    for w, ref in zip(weights, ref_weights):
        np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-6)


def test_mixed_bfloat16_is_finite_and_close():
    lm = build(seed=4, dtype="mixed_bfloat16")
    x, y, weights = batch(seed=4)
    lm.head_block_size = 0
    ref_loss, ref_grads = loss_and_gradients(lm, x, y, weights)
    lm.head_block_size = 4
    loss, grads = loss_and_gradients(lm, x, y, weights)
    assert np.isfinite(loss) and loss == pytest.approx(ref_loss, rel=2e-2)
    assert all(np.all(np.isfinite(g)) for g in grads)
    assert_gradients_close(grads, ref_grads, 5e-2)


def test_regularization_losses_are_added():
    x, y, weights = batch(seed=5)
    losses = []
    for block_size in (0, 4):
        lm = build(seed=5, head_block_size=block_size)
        kernel = lm.hash_decoder.down_denses[0].kernel
        kernel.regularizer = keras.regularizers.L2(10.0)
        assert len(lm.losses) == 1
        losses.append(loss_and_gradients(lm, x, y, weights)[0])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert losses[0] > loss_and_gradients(build(seed=5), x, y, weights)[0]


def test_what_needs_the_logits_trains_unchunked_or_is_refused():
    x, _, _ = batch()
    lm = build()
    assert fused_loss.uses_fused_head(lm)
    lm.compile(loss=keras.losses.MeanSquaredError())
    assert not fused_loss.uses_fused_head(lm)  # automatic: unchunked
    assert len(lm(x, training=True).shape) == 4
    lm.compile(weighted_metrics=["mae"])
    assert not fused_loss.uses_fused_head(lm)
    lm.head_block_size = 8
    with pytest.raises(ValueError, match="head_block_size=0"):
        lm(x, training=True)
    with pytest.raises(ValueError, match="compiled metrics"):
        lm.compile(weighted_metrics=["mae"])
    assert len(lm(x, training=False).shape) == 4  # inference: logits


def test_config_and_old_configs():
    lm = build(head_block_size=16)
    assert lm.get_config()["head_block_size"] == 16
    config = lm.get_config()
    del config["head_block_size"]  # a config of the previous release
    restored = MultiHashFormerCausalLM.from_config(config)
    assert restored.head_block_size is None
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="head_block_size"):
            fused_loss.check_block_size(bad)
    assert fused_loss.automatic_block_size(4, 16384) == 256


def test_blocks_follow_the_devices_memory():
    """2^24 logits per block on a CPU; on an accelerator the largest power
    of two of logits within 1/256 of its memory, never fewer."""
    block = fused_loss.automatic_block_size
    assert block(4, 16384, None) == 256
    assert block(4, 16384, 60_129_542_144) == 2048  # an H100 under JAX
    assert block(4, 16384, 112_583_507_968) == 4096  # an H200 under JAX
    assert block(4, 16384, 150_754_820_096) == 8192  # an H200, PyTorch
    assert block(4, 16384, 2**30) == 256  # a small device: the CPU's
    assert block(4, 2**22, None) == 8  # at least 8 positions


@pytest.mark.skipif(
    keras.config.backend() != "jax", reason="the recipe check runs on JAX"
)
def test_recipe_log_is_the_same_for_20_steps(tmp_path, capsys, monkeypatch):
    """The recipe's log.csv with the fused head, and with the fused head and
    `--rematerialize` (blocks recomputed in the backward pass), equals the
    unchunked head's for 20 steps (a row, validated and checkpointed, every
    5)."""
    from tests.pretraining.test_pretraining import recipe_main
    from tests.pretraining_helpers import RUN
    from tests.pretraining_helpers import prepared_corpus
    from tests.pretraining_helpers import run_flags

    corpus, _ = prepared_corpus(str(tmp_path / "corpus"))
    settings = dict(RUN, steps=20, checkpoint_every=5, validation_blocks=4)

    def log_of(name, *flags):
        output = tmp_path / name
        status, _, err = recipe_main(
            ["--data", corpus, "--output", output, "--no-calibrate", *flags]
            + run_flags(settings),
            capsys,
        )
        assert status == 0, err[-3000:]
        with open(os.path.join(output, "log.csv"), newline="") as f:
            return list(csv.DictReader(f))

    fused = log_of("fused")
    rematerialized = log_of("rematerialized", "--rematerialize")
    monkeypatch.setattr(fused_loss, "uses_fused_head", lambda task: False)
    unchunked = log_of("unchunked")
    assert len(fused) == len(rematerialized) == len(unchunked) == 4
    for row, ref in [*zip(fused, unchunked), *zip(rematerialized, unchunked)]:
        assert row.keys() == ref.keys()
        for key in row:
            if key == "seconds":
                continue
            try:
                value, expected = float(row[key]), float(ref[key])
            except ValueError:
                assert row[key] == ref[key]
                continue
            assert value == pytest.approx(expected, rel=1e-5, abs=1e-7), key


def test_compile_builds_the_default_objectives(lm):
    """With the default loss and metrics, `compile` builds them from shapes:
    the first training step need not run the model on the batch to build
    them (on PyTorch that was a full forward pass with the unfused head)."""
    from keras_mhf.models import StandardCausalLM
    from keras_mhf.models import standard_backbone

    assert lm._compile_loss.built
    standard = StandardCausalLM(standard_backbone(64, "tiny"), None)
    standard.compile(optimizer="sgd")
    assert standard._compile_loss.built
    assert standard._compile_metrics.built
    x, y, weights = batch(seed=6)
    logs = standard.train_on_batch(x, y, weights, return_dict=True)
    assert set(logs) == {"loss", "sparse_categorical_accuracy"}
    # A string metric depends on the targets' shape: Keras builds it.
    standard.compile(optimizer="sgd", weighted_metrics=["accuracy"])
    assert not standard._compile_metrics.built
