"""Multi-device and multi-host training with `keras.distribution`.

Backend-specific module. In keras 3.15 the distribution API works on JAX
only: TensorFlow accepts a distribution and silently trains on one device,
and PyTorch has none. `make_distribution` therefore refuses other backends
with a clear message rather than train on one device unnoticed.

    dist = make_distribution("data")                 # DataParallel, all devices
    dist = make_distribution("model", mesh=(2, 4))   # batch x model mesh
    dist = make_distribution("fsdp")                 # weights split by batch
    keras.distribution.set_distribution(dist)        # then build and fit

Across processes, `"data"` replicates the weights on every process,
`"model"` splits them over a model axis inside each process, and `"fsdp"`
(fully sharded data parallelism, as FSDP / ZeRO-3) splits every weight and
its optimizer state along the batch axis, which spans the processes: each
process holds only its shards, and XLA gathers a weight where a step needs
it whole. In each, a process streams only its own rows of every batch.

Beyond one machine, every process calls `initialize(coordinator, num_processes,
process_id)` first (`keras.distribution.initialize`, i.e. `jax.distributed`);
`keras.distribution.list_devices()` then lists the devices of all processes.
"""

import contextlib

import keras
import numpy as np

from keras_mhf.pretraining.peer_watch import PeerWatch
from keras_mhf.settings.rules import parse_mesh
from keras_mhf.utils.keras_private import set_value_in_place

KINDS = ("data", "model", "fsdp")


def check_backend():
    backend = keras.config.backend()
    if backend != "jax":
        raise ValueError(
            f"Multi-device training needs the JAX backend; this process runs "
            f"Keras on {backend!r}. In keras 3.15 `keras.distribution` is a "
            "silent no-op on TensorFlow (it would train on one device) and "
            "does not exist on PyTorch. Run with KERAS_BACKEND=jax."
        )


def make_distribution(kind, mesh=None, devices=None, config=None):
    """A `keras.distribution.Distribution` for MHF (or Standard) training.

    Args:
        kind: `"data"` (DataParallel) or `"model"` (ModelParallel with
            `MultiHashFormerBackbone.get_layout_map`; the same rules cover
            the Standard Qwen3 blocks).
        mesh: `(batch, model)` sizes; `"data"` defaults to all devices on the
            batch axis, `"model"` requires it.
        devices: defaults to `keras.distribution.list_devices()`.
        config: the backbone config (or
            `keras_mhf.models.architecture_config(name)`) of the model to be
            built. With it, model parallelism fits the layout to the model
            (dimensions a mesh axis does not divide are replicated) and
            checks it up front; without it, the layout map fits itself to
            each backbone when the backbone is built (the same fit). Either
            way a warning names the replicated dimensions.
    """
    check_backend()
    from keras_mhf.models.multi_hash_former.multi_hash_former_backbone import (
        MultiHashFormerBackbone,
    )
    from keras_mhf.models.multi_hash_former.multi_hash_former_layout import (
        check_layout_map,
    )

    devices = devices or keras.distribution.list_devices()
    if kind not in KINDS:
        raise ValueError(f"distribution must be one of {KINDS}; got {kind!r}.")
    if kind == "fsdp":
        batch, model = parse_mesh(mesh) if mesh else (len(devices), 1)
        if model != 1 or batch != len(devices):
            raise ValueError(
                f"Fully sharded data parallelism uses every device on the "
                f"batch axis: a ({len(devices)}, 1) mesh; got {mesh}."
            )
        return FullyShardedDataParallel(
            keras.distribution.DeviceMesh((batch,), ("batch",), devices)
        )
    if kind == "data":
        if mesh is None:
            return keras.distribution.DataParallel(devices=devices)
        batch, model = parse_mesh(mesh)
        if model != 1:
            raise ValueError("Data parallelism uses a (batch, 1) mesh.")
        mesh = (batch, 1)
    if mesh is None:
        raise ValueError("Model parallelism needs a mesh, e.g. mesh=(2, 4).")
    batch, model = parse_mesh(mesh)
    if batch * model != len(devices):
        raise ValueError(
            f"A {batch}x{model} mesh needs {batch * model} devices; "
            f"{len(devices)} are available."
        )
    if kind == "data":
        return keras.distribution.DataParallel(devices=devices[:batch])
    device_mesh = keras.distribution.DeviceMesh(
        (batch, model), ("batch", "model"), devices
    )
    layout_map = MultiHashFormerBackbone.get_layout_map(
        device_mesh, config=config
    )
    if config is not None:
        check_layout_map(layout_map, config)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def fsdp_axes(shape, parts):
    """The layout axes of a weight of `shape` under fully sharded data
    parallelism over `parts` devices: its largest dimension that `parts`
    divides is split along `"batch"`, the others are whole (a weight no
    dimension of which divides is replicated).

    >>> fsdp_axes((1000, 64), 8)
    ['batch', None]
    >>> fsdp_axes((3,), 8)
    [None]
    """
    axes = [None] * len(shape)
    divisible = [i for i, size in enumerate(shape) if size % parts == 0]
    if divisible:
        axes[max(divisible, key=lambda i: shape[i])] = "batch"
    return axes


class FullyShardedDataParallel(keras.distribution.ModelParallel):
    """Data parallelism whose weights and optimizer state are split along
    the batch axis (FSDP / ZeRO-3), through `keras.distribution` layouts:
    each weight's layout comes from its shape (`fsdp_axes`), so the same
    rule covers every model and the optimizer's slots (which take their
    weight's shape). The batch is split along the same axis.

    Args:
        device_mesh: a 1-D `keras.distribution.DeviceMesh` named `"batch"`.

    Example:

    ```python
    mesh = keras.distribution.DeviceMesh((8,), ("batch",))
    keras.distribution.set_distribution(FullyShardedDataParallel(mesh))
    ```
    """

    def __init__(self, device_mesh):
        super().__init__(
            layout_map=keras.distribution.LayoutMap(device_mesh),
            batch_dim_name="batch",
        )

    def get_variable_layout(self, variable):
        layout = getattr(variable, "_layout", None)
        if layout is not None:
            return layout
        return keras.distribution.TensorLayout(
            fsdp_axes(variable.shape, self.device_mesh.shape[0]),
            self.device_mesh,
        )


def check_model_axis(distribution, local_devices):
    """Across processes, a model axis must stay inside each process: the
    processes stream disjoint rows, so no batch shard may span two of them.
    """
    mesh = distribution.device_mesh
    if "model" not in mesh.axis_names:
        return
    model = mesh.shape[mesh.axis_names.index("model")]
    if local_devices % model:
        raise ValueError(
            f"The model axis ({model} devices) would span processes of "
            f"{local_devices} devices each; use a model axis that divides "
            f"{local_devices}, or --distribution fsdp to split the weights "
            "across processes."
        )


@contextlib.contextmanager
def whole_weights(lm):
    """Lets one process read every weight of `lm` whole (to save a preset):
    where weights are split across processes, every process gathers each
    one (`process_allgather`) and the variables hold the whole values until
    the block ends; otherwise nothing changes. Every process must enter it.
    """
    import jax

    variables = [
        v
        for v in lm.weights
        if isinstance(v.value, jax.Array) and not v.value.is_fully_addressable
    ]
    if not variables:
        yield
        return
    from jax.experimental import multihost_utils

    kept = [v.value for v in variables]
    try:
        for variable in variables:
            whole = multihost_utils.process_allgather(
                variable.value, tiled=True
            )
            set_value_in_place(variable, jax.numpy.asarray(np.asarray(whole)))
        yield
    finally:
        for variable, value in zip(variables, kept):
            set_value_in_place(variable, value)


def batch_axis_size(distribution):
    """How many ways the batch is split."""
    mesh = distribution.device_mesh
    name = getattr(distribution, "batch_dim_name", None) or mesh.axis_names[0]
    return mesh.shape[mesh.axis_names.index(name)]


def check_batch_size(batch_size, distribution, what=None):
    """Every batch must divide the batch axis; say so before XLA does.
    `what`: how the message names the batch (default `batch_size=N`)."""
    parts = batch_axis_size(distribution)
    if batch_size % parts:
        raise ValueError(
            f"{what or f'batch_size={batch_size}'} does not divide the "
            f"{parts}-way batch "
            f"axis of the device mesh. Use a multiple of {parts} (the "
            "pre-training recipe drops no data: every step has exactly "
            "batch_size sequences)."
        )


def initialize(coordinator_address, num_processes, process_id):
    """Joins a multi-process JAX job (one call per process, before anything
    else touches the devices). On CPU hosts, collectives use gloo. A
    `PeerWatch` stops every process within seconds if one is lost."""
    check_backend()
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # option renamed or absent
        pass
    keras.distribution.initialize(
        job_addresses=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    # A lost process stops the others within seconds, in one line.
    PeerWatch.start(process_id, num_processes, coordinator_address)
