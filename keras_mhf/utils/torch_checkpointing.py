"""PyTorch only: rematerialisation that frees what it recomputes.

`without_early_stop` runs torch's checkpoints (what `keras.remat` calls)
without early stop, and `blockwise_sum` is the fused cascade head's loop.

Early stop: the non-reentrant checkpoint stops a recomputation by raising an
exception; passing through Keras' layer calls with traceback filtering on
(the default), its traceback keeps the recomputed function's frames in a
reference cycle, so every rematerialised trunk block's recomputed
activations stayed alive until Python's cyclic collector ran.

The fused head: under `keras.remat` inside its block loop, the backward
pass recomputed each block but kept every block's recomputation until it
ended, with or without early stop, so the head peaked as high as with no
rematerialisation at all. `blockwise_sum` is a `torch.autograd.Function`
instead: its forward pass runs every block under `no_grad`; its backward
pass recomputes one block, adds its gradients into the variables' in place
and frees it before the next (the same loss and gradients;
`python -m benchmarks.head_memory` measures the peak).
"""

import keras
import torch


def without_early_stop(function):
    """`function`, whose torch checkpoints (`keras.remat`) recompute their
    whole function instead of stopping early (see the module docstring).
    The setting is read when a checkpoint runs forward."""

    def call(*args):
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return function(*args)

    return call


def blockwise_sum(function, variables, blocked):
    """`sum(function(*[x[i] for x in blocked]) for i in range(blocks))`,
    differentiable with respect to the floating tensors of `blocked` and
    the trainable `variables`, holding one block's intermediates at a time.

    Args:
        function: maps one block's tensors to a float scalar. It reads the
            `variables` (a layer's weights) and must not update any.
        variables: the Keras variables `function` reads.
        blocked: tensors with a leading block axis, `blocks` long.

    Returns:
        The float32 scalar sum.

    Example:

    ```python
    total = blockwise_sum(
        lambda x: ops.sum(layer(x)), layer.variables, [blocked_inputs]
    )
    ```
    """
    variables = [v for v in variables if v.trainable]
    values = [keras.ops.convert_to_tensor(v) for v in variables]
    return _BlockwiseSum.apply(
        function, variables, len(blocked), *blocked, *values
    )


class _BlockwiseSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, variables, count, *tensors):
        blocked = tensors[:count]
        with torch.no_grad():
            total = torch.zeros(
                (), dtype=torch.float32, device=blocked[0].device
            )
            for index in range(blocked[0].shape[0]):
                block = [x[index] for x in blocked]
                total = total + function(*block).to(torch.float32)
        ctx.function, ctx.variables, ctx.count = function, variables, count
        ctx.save_for_backward(*tensors)
        return total

    @staticmethod
    def backward(ctx, upstream):
        tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]  # after function, variables, count
        blocked, values = tensors[: ctx.count], tensors[ctx.count :]
        block_needs, value_needs = needs[: ctx.count], needs[ctx.count :]
        # One leaf per variable for all blocks: autograd adds each block's
        # gradient into its `.grad` in place, one head's table at a time.
        leaves = [
            v.detach().requires_grad_(need)
            for v, need in zip(values, value_needs)
        ]
        mapping = list(zip(ctx.variables, leaves))
        block_grads = [
            torch.zeros_like(x) if need else None
            for x, need in zip(blocked, block_needs)
        ]
        for index in range(blocked[0].shape[0]):
            block = [
                x[index].detach().requires_grad_(need)
                for x, need in zip(blocked, block_needs)
            ]
            inputs = [x for x in block + leaves if x.requires_grad]
            if not inputs:
                break
            with torch.enable_grad():
                with keras.StatelessScope(state_mapping=mapping):
                    loss = ctx.function(*block).to(torch.float32)
                torch.autograd.backward(loss, upstream, inputs=inputs)
            for total, x in zip(block_grads, block):
                if total is not None and x.grad is not None:
                    total[index] = x.grad
            del loss, block, inputs
        value_grads = [v.grad if v.requires_grad else None for v in leaves]
        return (None, None, None, *block_grads, *value_grads)
