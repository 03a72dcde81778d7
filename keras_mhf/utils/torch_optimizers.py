"""PyTorch only: optimizer updates whose temporaries stay small.

Keras' PyTorch Adam / AdamW update every variable at once with
`torch._foreach_*` ops, and its out-of-place ones (`m * alpha`, `sqrt(v)`,
`+ epsilon`, the division) each allocate a copy of all the parameters,
which made `optimizer.apply` the highest point of memory in the training
step at the paper's 100M shape. `update_in_groups` runs the same update on groups
of variables of at most `GROUP_BYTES` (a larger variable is a group of its
own), so that the temporaries are a group's, not the model's. Every
element goes through the same ops in the same order: the weights are
bit-identical.
"""

from keras_mhf.utils.keras_private import parallel_update_step
from keras_mhf.utils.keras_private import set_parallel_update_step

GROUP_BYTES = 64 * 2**20


def variable_groups(variables, group_bytes=GROUP_BYTES):
    """`(start, end)` of consecutive variables holding at most
    `group_bytes` together (a larger variable alone)."""
    groups, start, size = [], 0, 0
    for i, variable in enumerate(variables):
        value = variable.value
        nbytes = value.numel() * value.element_size()
        if i > start and size + nbytes > group_bytes:
            groups.append((start, i))
            start, size = i, 0
        size += nbytes
    if start < len(variables):
        groups.append((start, len(variables)))
    return groups


def update_in_groups(optimizer, group_bytes=GROUP_BYTES):
    """Makes a Keras PyTorch optimizer that updates all its variables at once
    (`_parallel_update_step`, e.g. Adam and AdamW) update them in groups of
    at most `group_bytes`. The instance keeps its class and config (it
    saves and loads as before, on any backend). Returns `optimizer`."""
    update = parallel_update_step(optimizer)
    if update is None or getattr(update, "in_groups", False):
        return optimizer

    def grouped(grads, variables, learning_rate):
        for start, end in variable_groups(variables, group_bytes):
            update(grads[start:end], variables[start:end], learning_rate)

    grouped.in_groups = True
    set_parallel_update_step(optimizer, grouped)
    return optimizer
