"""The fused, chunked cascade head for training (paper Sec. 3.3-3.4).

`fused_signature_loss` computes `SignatureCrossEntropy` straight from the
final hidden states: the positions are cut into blocks of `block_size`, and
for each block the H heads' logits, the cascade's soft retrievals (Sec. 3.3)
and the per-head cross-entropy (Sec. 3.4, training) run under
`keras.remat`, inside `keras.ops.scan` (on PyTorch, whose checkpoint
keeps every block's recomputation until the backward pass ends, in an
autograd Function instead: `keras_mhf.utils.torch_checkpointing`). Neither
pass ever holds the `[b, s, H, B]` logits or their softmaxes: the forward
pass keeps one block's worth, and the backward pass recomputes one block at
a time, keeping only the block inputs (`[n, d]` hidden states). The result
equals the unchunked `SignatureCrossEntropy` with its default reduction
`mean_with_sample_weight`: the weighted sum of per-position losses over the
sum of weights (over the number of positions when there is no weight).
"""

import keras
from keras import ops

from keras_mhf.losses.signature_cross_entropy import signature_cross_entropy
from keras_mhf.utils.device_memory import accelerator_memory_bytes
from keras_mhf.utils.keras_utils import rematerialized

# Automatic block on a CPU: about 2^24 float logits per block (64 MiB in
# float32 for all H heads), e.g. 256 positions at H = 4, B = 16,384.
BLOCK_LOGITS = 2**24
# On an accelerator a block's logits take up to 1/256 of its memory in
# floats: the backward pass of a block holds a few float32 arrays of the
# logits' size (logits, softmax, their gradient), about 1/16 of the memory
# in all, so that the heads' matmuls are large and the scan's sequential
# steps few (at H = 4, B = 16,384: 8,192 positions per block where the
# device reports 141 GB, 4,096 where JAX's pool reports 113 GB).
ACCELERATOR_MEMORY_PER_LOGIT = 256


def automatic_block_size(num_hashes, num_buckets, device_memory=None):
    """Positions per block of the fused head (at least 8): one block's
    `H x B` logits are about `BLOCK_LOGITS` floats on a CPU
    (`device_memory=None`), and on an accelerator of `device_memory` bytes
    the largest power of two of floats within
    `device_memory / ACCELERATOR_MEMORY_PER_LOGIT` (never fewer than on a
    CPU).

    Example:

    ```python
    automatic_block_size(4, 16384)  # 256 (a CPU)
    automatic_block_size(4, 16384, 80 * 10**9)  # 4096 (an 80 GB GPU)
    ```
    """
    logits = BLOCK_LOGITS
    if device_memory:
        budget = int(device_memory) // ACCELERATOR_MEMORY_PER_LOGIT
        logits = max(logits, 1 << (budget.bit_length() - 1))
    return max(8, logits // (num_hashes * num_buckets))


def check_block_size(block_size):
    """`head_block_size`: `None` (automatic), 0 (unchunked) or a positive
    int, returned as such."""
    if block_size is None:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(
            "`head_block_size` must be None (automatic), 0 (unchunked) or a "
            f"positive int; got {block_size!r}."
        )
    if block_size < 0:
        raise ValueError(
            f"`head_block_size` must be >= 0; got {block_size} (0 means the "
            "unchunked head)."
        )
    return block_size


def fused_signature_loss(
    decoder, hidden_states, signatures, sample_weight, block_size=None
):
    """`SignatureCrossEntropy()(signatures, decoder(hidden_states),
    sample_weight)` without forming the bucket logits of all positions.

    Args:
        decoder: the `CascadeHashDecoder`.
        hidden_states: float `[b, s, d]` (any leading axes), the trunk's
            final hidden states.
        signatures: int `[b, s, H]`, the targets' signatures.
        sample_weight: `None` or weights broadcastable to `[b, s]`.
        block_size: positions per block; `None` chooses
            `automatic_block_size` for the backend's device.

    Returns:
        The float32 scalar loss.
    """
    num_hashes, dim = decoder.num_hashes, decoder.hidden_dim
    if block_size is None:
        block_size = automatic_block_size(
            num_hashes, decoder.num_buckets, accelerator_memory_bytes()
        )
    leading = ops.shape(signatures)[:-1]
    states = ops.reshape(hidden_states, (-1, dim))
    targets = ops.reshape(ops.cast(signatures, "int32"), (-1, num_hashes))
    if sample_weight is None:
        weights = ops.ones(ops.shape(targets)[:1], "float32")
    else:
        weights = ops.convert_to_tensor(sample_weight, "float32")
        while len(weights.shape) < len(leading):
            weights = ops.expand_dims(weights, -1)
        weights = ops.reshape(ops.broadcast_to(weights, leading), (-1,))
    count = states.shape[0]  # None under TF's dynamic batch axis
    if count is None:
        count = ops.shape(states)[0]
        size = ops.minimum(block_size, count)
        blocks = (count + size - 1) // size
    else:
        size = max(1, min(block_size, count))
        blocks = -(-count // size)
    padding = blocks * size - count
    # Padded positions have weight 0 (and finite zero states).
    states = ops.pad(states, [[0, padding], [0, 0]])
    targets = ops.pad(targets, [[0, padding], [0, 0]])
    padded_weights = ops.pad(weights, [[0, padding]])

    blocked = (
        ops.reshape(states, (blocks, size, dim)),
        ops.reshape(targets, (blocks, size, num_hashes)),
        ops.reshape(padded_weights, (blocks, size)),
    )

    def block_loss(block_states, block_targets, block_weights):
        logits = ops.stack(decoder.head_logits(block_states), axis=-2)
        per_position = signature_cross_entropy(block_targets, logits)
        return ops.sum(per_position * block_weights)

    if keras.config.backend() == "torch":
        # torch's checkpoint keeps every block's recomputation until the
        # backward pass ends; this Function frees each block in turn.
        from keras_mhf.utils.torch_checkpointing import blockwise_sum

        total = blockwise_sum(block_loss, decoder.variables, blocked)
    else:
        total = _scanned_sum(block_loss, decoder.variables, blocked, blocks)
    if sample_weight is None:
        divisor = ops.cast(count, "float32")
    else:
        divisor = ops.sum(weights)
    return ops.divide_no_nan(total, divisor)


def _scanned_sum(block_loss, variables, blocked, blocks):
    """`sum(block_loss(*block))` over the blocks in `keras.ops.scan`, each
    block under `keras.remat` (JAX, TensorFlow)."""

    def step(total, index):
        # One scanned tensor: Keras' TF `scan` needs a static length for more.
        block = [ops.take(x, index, axis=0) for x in blocked]
        block_states, block_targets, block_weights = block

        def states_loss(block_states):
            return block_loss(block_states, block_targets, block_weights)

        # The decoder's variables (mixers and the tied tables) enter the
        # rematerialised function as arguments (`rematerialized`).
        loss = rematerialized(variables, states_loss)(block_states)
        return total + loss, loss

    total, _ = ops.scan(
        step, ops.zeros((), "float32"), ops.arange(blocks, dtype="int32")
    )
    return total


# What `MultiHashFormerCausalLM.call` returns (its `call_output`).
BUCKET_LOGITS = "bucket_logits"
HIDDEN_STATES = "hidden_states"


def objective_shapes(hash_decoder):
    """`(targets' signatures, bucket logits)` as `keras.KerasTensor`s
    `[b, s, H]` and `[b, s, H, B]`: what the task's compiled loss and
    metrics are built for before the first step
    (`CausalLMMixin.build_default_objectives`)."""
    hashes, buckets = hash_decoder.num_hashes, hash_decoder.num_buckets
    return (
        keras.KerasTensor((None, None, hashes), "int32"),
        keras.KerasTensor(
            (None, None, hashes, buckets), hash_decoder.compute_dtype
        ),
    )


def call_output(task, training):
    """What `task.call(inputs, training=training)` returns, decided here
    only: `HIDDEN_STATES` (the final hidden states `[b, s, d]`, from which
    `fused_compute_loss` computes the loss) for a training call with the
    fused head (`uses_fused_head`), otherwise `BUCKET_LOGITS` (the
    functional output `[b, s, H, B]`)."""
    if training and uses_fused_head(task):
        return HIDDEN_STATES
    return BUCKET_LOGITS


def uses_fused_head(task):
    """Whether `task`'s training steps use the fused head: `head_block_size`
    is not 0, and the model is compiled with the default objective (a
    `SignatureCrossEntropy` with reduction `mean_with_sample_weight`, no loss
    weights, no compiled metrics, which would need the logits). Otherwise
    the unchunked head is used when `head_block_size` is `None`, and an
    explicit block size is refused."""
    from keras_mhf.losses.signature_cross_entropy import SignatureCrossEntropy

    if task.head_block_size == 0 or not getattr(task, "compiled", False):
        return False
    loss = getattr(task, "loss", None)
    problems = []
    if not (
        type(loss) is SignatureCrossEntropy
        and loss.reduction == "mean_with_sample_weight"
    ):
        problems.append(f"loss={loss!r}")
    compile_loss = getattr(task, "_compile_loss", None)
    if getattr(compile_loss, "loss_weights", None) is not None:
        problems.append("loss_weights")
    if getattr(task, "_compile_metrics", None) is not None:
        problems.append("compiled metrics")
    if problems and task.head_block_size is not None:
        raise ValueError(
            f"head_block_size={task.head_block_size} trains with the fused "
            "head, which computes only the default SignatureCrossEntropy "
            f"and needs no logits; this model is compiled with "
            f"{', '.join(problems)}. Set `head_block_size=0` (unchunked) "
            "or `None` (fused when possible)."
        )
    return not problems


class StepSignatures:
    """The targets' signatures of the training or test step in progress,
    handed from the task's `compute_loss` to its `compute_metrics`
    (`MultiHashFormerCausalLM.step_signatures`).

    Why an object on the task: Keras' steps (`train_step` and `test_step`
    of every backend's trainer) call `compute_loss(x, y, y_pred, ...)` and
    then `compute_metrics(x, y, y_pred, ...)` with the same token targets
    `y` and pass nothing else between them. Both need `y`'s signatures
    `[b, s, H]`, and on JAX `compute_metrics` runs outside the stateless
    scope that holds the model's variables (`fit` has purged them), so the
    signature table cannot be read there. `look_up` (in `compute_loss`)
    reads the table once and records the signatures with their `y`;
    `take` (in `compute_metrics`) returns them and empties the object, so
    nothing outlives the step.
    """

    def __init__(self):
        self.clear()

    def clear(self):
        """Forgets the recorded targets and signatures."""
        self._targets = None
        self._signatures = None

    @property
    def pending(self):
        """Whether signatures were recorded and not taken yet."""
        return self._targets is not None

    def look_up(self, task, y):
        """`compute_loss`: token targets `y` `[b, s]` -> their signatures
        `[b, s, H]` from `task`'s table, recorded for the step's
        `compute_metrics` (`None` for `y=None`)."""
        if y is None:
            return None
        signatures = task.backbone.signature_lookup(y)
        self._targets, self._signatures = y, signatures
        return signatures

    def take(self, task, y):
        """`compute_metrics`: the signatures `look_up` recorded for this
        very `y` (looked up again for any other `y`); empties the object."""
        recorded = self._targets is y and y is not None
        signatures = self._signatures
        self.clear()
        if recorded:
            return signatures
        return None if y is None else task.backbone.signature_lookup(y)


def fused_compute_loss(task, signatures, hidden_states, sample_weight):
    """`Trainer.compute_loss` of a fused training step: the fused
    `SignatureCrossEntropy` (scaled for distribution like Keras' reduction)
    plus the model's regularization losses `task.losses`."""
    from keras_mhf.utils.keras_private import additional_loss
    from keras_mhf.utils.keras_private import scale_loss_for_distribution

    loss = fused_signature_loss(
        task.hash_decoder,
        hidden_states,
        signatures,
        sample_weight,
        task.head_block_size,
    )
    losses = [scale_loss_for_distribution(loss)]
    losses += [additional_loss(task, x) for x in task.losses]
    return losses[0] if len(losses) == 1 else ops.sum(losses)
