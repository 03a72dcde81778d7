"""Multi-device and multi-host training with `keras.distribution`.

Backend-specific module. In keras 3.15 the distribution API works on JAX
only: TensorFlow accepts a distribution and silently trains on one device,
and PyTorch has none. `make_distribution` therefore refuses other backends
with a clear message rather than train on one device unnoticed.

    dist = make_distribution("data")                 # DataParallel, all devices
    dist = make_distribution("model", mesh=(2, 4))   # batch x model mesh
    keras.distribution.set_distribution(dist)        # then build and fit

Beyond one machine, every process calls `initialize(coordinator, num_processes,
process_id)` first (`keras.distribution.initialize`, i.e. `jax.distributed`);
`keras.distribution.list_devices()` then lists the devices of all processes.
"""

import keras

KINDS = ("data", "model")


def check_backend():
    backend = keras.config.backend()
    if backend != "jax":
        raise ValueError(
            f"Multi-device training needs the JAX backend; this process runs "
            f"Keras on {backend!r}. In keras 3.15 `keras.distribution` is a "
            "silent no-op on TensorFlow (it would train on one device) and "
            "does not exist on PyTorch. Run with KERAS_BACKEND=jax."
        )


def parse_mesh(mesh):
    """`"2x4"` or `(2, 4)` -> `(2, 4)`."""
    if isinstance(mesh, str):
        try:
            mesh = tuple(int(p) for p in mesh.lower().split("x"))
        except ValueError as error:
            raise ValueError(
                f"--mesh must look like 2x4; got {mesh!r}."
            ) from error
    mesh = tuple(mesh)
    if len(mesh) != 2 or min(mesh) < 1:
        raise ValueError(f"The mesh must be (batch, model) sizes; got {mesh}.")
    return mesh


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


def batch_axis_size(distribution):
    """How many ways the batch is split."""
    mesh = distribution.device_mesh
    name = getattr(distribution, "batch_dim_name", None) or mesh.axis_names[0]
    return mesh.shape[mesh.axis_names.index(name)]


def check_batch_size(batch_size, distribution):
    """Every batch must divide the batch axis; say so before XLA does."""
    parts = batch_axis_size(distribution)
    if batch_size % parts:
        raise ValueError(
            f"batch_size={batch_size} does not divide the {parts}-way batch "
            f"axis of the device mesh. Use a multiple of {parts} (the "
            "pre-training recipe drops no data: every step has exactly "
            "batch_size sequences)."
        )


def initialize(coordinator_address, num_processes, process_id):
    """Joins a multi-process JAX job (one call per process, before anything
    else touches the devices). On CPU hosts, collectives use gloo."""
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
