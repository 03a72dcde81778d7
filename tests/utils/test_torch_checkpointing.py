"""`blockwise_sum` (PyTorch's fused-head loop, #23): the sum and gradients of
plain autograd, and a backward pass that holds one block's recomputation at
a time."""

import gc
import weakref

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.config.backend() != "torch", reason="a PyTorch-only module"
)


@pytest.fixture(scope="module")
def layer():
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(6)
    dense.build((None, 5))
    return dense


def block_inputs(blocks=4):
    rng = np.random.default_rng(0)
    x = keras.ops.convert_to_tensor(rng.normal(size=(blocks, 3, 5)), "float32")
    weights = keras.ops.convert_to_tensor(rng.random((blocks, 3)), "float32")
    return x, weights


def test_sum_and_gradients_equal_plain_autograd(layer):
    import torch

    from keras_mhf.utils.torch_checkpointing import blockwise_sum

    def block_loss(x, weights):
        y = keras.ops.tanh(layer(x))
        return keras.ops.sum(keras.ops.sum(y * y, axis=-1) * weights)

    x, weights = block_inputs()
    results = []
    for fused in (True, False):
        inputs = x.detach().clone().requires_grad_(True)
        if fused:
            total = blockwise_sum(
                block_loss, layer.variables, [inputs, weights]
            )
        else:
            total = sum(block_loss(inputs[i], weights[i]) for i in range(4))
        sources = [inputs] + [v.value for v in layer.trainable_variables]
        grads = torch.autograd.grad(3.0 * total, sources)
        results.append([total.detach().numpy()] + [g.numpy() for g in grads])
    for fused, plain in zip(*results):
        np.testing.assert_allclose(fused, plain, rtol=1e-6, atol=1e-7)


def peak_saved_bytes(function, variables, blocked):
    """The most bytes autograd held saved for a backward pass at once, over
    `blockwise_sum`'s forward and backward passes: PyTorch's saved-tensor
    hooks see each tensor a graph saves, and the packed object dies when
    the graph lets the tensor go."""
    import torch

    from keras_mhf.utils.torch_checkpointing import blockwise_sum

    live = {"now": 0, "most": 0}

    def release(nbytes):
        live["now"] -= nbytes

    class Saved:
        def __init__(self, tensor):
            self.tensor = tensor
            live["now"] += tensor.nbytes
            live["most"] = max(live["most"], live["now"])
            weakref.finalize(self, release, tensor.nbytes)

    with torch.autograd.graph.saved_tensors_hooks(Saved, lambda s: s.tensor):
        total = blockwise_sum(function, variables, blocked)
        total.backward()
    gc.collect()
    assert live["now"] == 0  # every saved tensor was let go
    return live["most"]


def test_backward_holds_one_block_at_a_time(layer):
    def block_loss(x, weights):
        y = keras.ops.tanh(layer(x))
        return keras.ops.sum(keras.ops.sum(y * y, axis=-1) * weights)

    x, weights = block_inputs(blocks=8)
    peaks = []
    for blocks in (1, 8):
        inputs = x[:blocks].detach().clone().requires_grad_(True)
        peaks.append(
            peak_saved_bytes(
                block_loss, layer.variables, [inputs, weights[:blocks]]
            )
        )
    one_block, eight_blocks = peaks
    # The Function keeps its inputs (8x larger) and one block's graph.
    inputs_bytes = 8 * 3 * 5 * 4 + 8 * 3 * 4
    assert one_block > 0
    assert eight_blocks <= one_block + inputs_bytes
    for variable in layer.variables:
        variable.value.grad = None


def test_rematerialized_blocks_leave_no_checkpoint_in_a_reference_cycle():
    """Rematerialised trunk blocks on PyTorch: after the backward pass no
    checkpoint frame (holding a block's recomputed activations) waits for
    Python's cyclic collector, as torch's early stop left them: its
    exception, passing through Keras' traceback filtering (on by default,
    off in these tests), was kept in a reference cycle."""
    import torch.utils.checkpoint

    from keras_mhf.models import MultiHashFormerCausalLM

    def frames():
        return sum(
            isinstance(o, torch.utils.checkpoint._CheckpointFrame)
            for o in gc.get_objects()
        )

    keras.utils.set_random_seed(0)
    tokens = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(29)]
    backbone = MultiHashFormerCausalLM.from_tokens(
        tokens, "tiny_h3b64", pad_token_id=0, rematerialize=True
    ).backbone
    ids = np.random.default_rng(0).integers(3, 32, (2, 7)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    gc.collect()
    gc.disable()
    keras.config.enable_traceback_filtering()
    try:
        before = frames()
        hidden = backbone(x, training=True)
        keras.ops.sum(hidden * hidden).backward()
        leftover = frames() - before
    finally:
        keras.config.disable_traceback_filtering()
        gc.enable()
    assert leftover == 0
