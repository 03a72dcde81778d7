"""The variables of a checkpoint, written and read with Orbax
(`orbax-checkpoint`), on every backend.

Orbax writes each process's shards of every variable (model weights and
optimizer state) into the step's directory, asynchronously: `save` returns
once the values are copied off the devices, and training goes on while they
are written. It writes under a temporary name
(`step_NNNNNN.orbax-checkpoint-tmp-*`) and renames the directory once every
process has written its part (the atomic commit), removes temporary
directories that a killed run left, and keeps the last `keep` checkpoints.
Before the rename, process 0 adds `state.json` (the run state and the size
and sha256 of every file of the checkpoint), so that a damaged file is found
before a resume trusts it.

On JAX the values are the variables' (possibly sharded) arrays, and a
restore puts each shard straight onto the current layout (also another mesh
or process count); TensorFlow and PyTorch give numpy copies.

    writer = CheckpointWriter("runs/mhf/checkpoints", keep=2)
    writer.save(100, lm, state)         # returns while the write goes on
    writer.wait()                       # the checkpoint is committed
    restore_variables("runs/mhf/checkpoints/step_000100", lm)
"""

import glob
import os

import keras
import numpy as np

from keras_mhf.pretraining.errors import NonFiniteValues
from keras_mhf.utils import hooks
from keras_mhf.utils.files import file_sha256
from keras_mhf.utils.files import fsync_directory
from keras_mhf.utils.files import write_json

VARIABLES = "variables"  # the Orbax item holding the arrays
STATE_FILE = "state.json"
# Orbax's step metadata (commit time), rewritten at the commit, after
# `state.json`: outside the manifest.
STEP_METADATA = "_CHECKPOINT_METADATA"
STEP_PREFIX, STEP_DIGITS = "step", 6
# Orbax's mark of a directory being written (`ocp.path.step.TMP_DIR_SUFFIX`).
TEMPORARY_MARK = ".orbax-checkpoint-tmp"


def _orbax():
    import orbax.checkpoint as ocp

    return ocp


def _groups(lm):
    """`{"model": [variables], "optimizer": [variables]}` in Keras' order
    (the order of `save_weights`: fixed by the architecture, unlike the
    variables' paths, whose layer names may carry a per-process counter)."""
    groups = {"model": list(lm.weights)}
    if lm.optimizer is not None:
        groups["optimizer"] = list(lm.optimizer.variables)
    return groups


def all_finite(values):
    """One flag per value: whether all its entries are finite."""
    return keras.ops.stack(
        [keras.ops.all(keras.ops.isfinite(value)) for value in values]
    )


def finite_flags_later(values):
    """A callable giving `all_finite(values)` in numpy, started now and read
    when called. On JAX one compiled program is dispatched, which runs
    while the training goes on (values split across processes included: the
    flags are then gathered, a collective every process must call); numpy
    copies are checked when it is called (e.g. in Orbax's writing thread);
    other tensors through `keras.ops`.

    Example:

    ```python
    flags = finite_flags_later([v.value for v in lm.weights])
    assert flags().all()
    ```
    """
    if keras.config.backend() == "jax":
        import jax

        flags = jax.jit(all_finite)(values)

        def read():
            if flags.is_fully_addressable:
                return np.asarray(flags)
            from jax.experimental import multihost_utils

            return np.asarray(
                multihost_utils.process_allgather(flags, tiled=True)
            )

        return read
    if all(isinstance(value, np.ndarray) for value in values):
        return lambda: np.array([np.isfinite(value).all() for value in values])
    return lambda: np.asarray(keras.ops.convert_to_numpy(all_finite(values)))


def _key(index):
    return f"{index:05d}"


def variable_tree(lm):
    """`{"model": {"00000": value, ...}, "optimizer": {...}}` of the model's
    variables and its optimizer's, numbered in Keras' order; the values are
    jax arrays on JAX (sharded as the variables are), copies in numpy
    otherwise (the training goes on while they are written)."""
    jax = keras.config.backend() == "jax"

    def value(v):
        if jax:
            return v.value
        return np.array(keras.ops.convert_to_numpy(v.value), copy=True)

    return {
        group: {_key(i): value(v) for i, v in enumerate(variables)}
        for group, variables in _groups(lm).items()
    }


def file_manifest(directory, skip=(STATE_FILE, STEP_METADATA)):
    """`{relative path: {"bytes", "sha256"}}` of every file under
    `directory` (but `skip`)."""
    manifest = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory)
            if relative in skip:
                continue
            manifest[relative] = {
                "bytes": os.path.getsize(path),
                "sha256": file_sha256(path),
            }
    return dict(sorted(manifest.items()))


def check_manifest(directory, manifest):
    """The first problem with the files `manifest` records, or `None`."""
    for relative, expected in manifest.items():
        path = os.path.join(directory, relative)
        if not os.path.isfile(path):
            return f"{path} is missing"
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            return (
                f"{path} has {size} bytes, the state records "
                f"{expected['bytes']} (truncated or damaged)"
            )
        if file_sha256(path) != expected["sha256"]:
            return (
                f"{path} does not match the sha256 its state records (damaged)"
            )
    return None


class CheckpointWriter:
    """Writes checkpoints `ROOT/step_NNNNNN/` asynchronously with Orbax's
    `CheckpointManager` (see the module docstring).

    Args:
        root: the checkpoints' directory (created if needed).
        keep: how many of the newest checkpoints are kept.

    Every process of a multi-process job makes one and calls `save` with the
    same step (each writes its own shards); process 0 writes `state.json`.
    """

    def __init__(self, root, keep):
        ocp = _orbax()
        self.root = root
        self._pending = None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            step_name_format=ocp.step.standard_name_format(
                step_prefix=STEP_PREFIX, step_format_fixed_length=STEP_DIGITS
            ),
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(
                post_finalization_callback=self._write_state,
                # The step's directories too are made off the training
                # thread.
                create_directories_asynchronously=True,
            ),
        )
        self._manager = ocp.CheckpointManager(
            root, options=options, item_names=(VARIABLES,)
        )

    def save(self, step, lm, state, check_finite=True):
        """Starts writing the checkpoint of `step` (after the previous one
        is committed); returns once the values are off the devices.

        Args:
            step: the global step.
            lm: the model (with its optimizer).
            state: the run state for `state.json` (process 0's is written);
                the files' manifest is added under `"files"`.
            check_finite: check that every float value is finite before the
                commit, while the training goes on: a checkpoint with a NaN
                or infinite value is never committed, and `wait` raises
                `NonFiniteValues`. (Single-process only: the check runs in
                process 0's writing thread, where no collective can run.)
        """
        ocp = _orbax()
        self.wait()
        tree = variable_tree(lm)
        check = None
        if check_finite:
            written = [
                (v.path, tree[group][_key(i)])
                for group, variables in _groups(lm).items()
                for i, v in enumerate(variables)
                if "float" in keras.backend.standardize_dtype(v.dtype)
            ]
            flags = finite_flags_later([value for _, value in written])
            check = (flags, [path for path, _ in written])
        self._pending = (step, state, check)
        self._manager.save(
            step,
            args=ocp.args.Composite(**{VARIABLES: ocp.args.StandardSave(tree)}),
            force=True,
        )
        hooks.event("checkpoint_started", path=self.directory(step))

    def directory(self, step):
        return os.path.join(self.root, f"{STEP_PREFIX}_{step:0{STEP_DIGITS}d}")

    def _write_state(self):
        """Orbax's hook on process 0 once every process has written its
        shards, before the rename: the finite check, then `state.json` with
        the files' manifest. Raising here stops the commit."""
        step, state, check = self._pending
        if check is not None:
            flags, paths = check
            bad = [path for path, ok in zip(paths, flags()) if not ok]
            if bad:
                raise NonFiniteValues(step, bad)
        final = self.directory(step)
        (temporary,) = glob.glob(glob.escape(final) + TEMPORARY_MARK + "*")
        state = dict(state, files=file_manifest(temporary))
        write_json(os.path.join(temporary, STATE_FILE), state)
        fsync_directory(temporary)
        hooks.event("checkpoint_complete", path=temporary)

    @property
    def pending_step(self):
        """The step of the checkpoint being written, or `None`."""
        return None if self._pending is None else self._pending[0]

    def wait(self):
        """Waits until the last checkpoint started is committed; raises
        what its write raised (e.g. an error of a full disk)."""
        step = self.pending_step
        try:
            self._manager.wait_until_finished()
        finally:
            self._pending = None
        if step is not None:
            hooks.event("checkpoint_committed", path=self.directory(step))

    def close(self, wait=True):
        """Waits for the last checkpoint (unless `wait=False`) and releases
        Orbax's threads."""
        try:
            if wait:
                self.wait()
        finally:
            self._manager.close()


def restore_variables(directory, lm):
    """Loads the variables of the checkpoint `directory` into `lm` (its
    optimizer built): on JAX each shard goes straight onto the variable's
    current layout.

    Raises:
        ValueError: the checkpoint's variables are not the model's (names
            the first that differs).
    """
    ocp = _orbax()
    groups = _groups(lm)
    path = os.path.join(os.path.abspath(directory), VARIABLES)
    checkpointer = ocp.StandardCheckpointer()
    try:
        saved = checkpointer.metadata(path).item_metadata.tree
        _check_shapes(groups, saved)
        restored = checkpointer.restore(
            path,
            {
                group: {_key(i): _target(v) for i, v in enumerate(variables)}
                for group, variables in groups.items()
            },
        )
    finally:
        checkpointer.close()
    for group, variables in groups.items():
        for i, variable in enumerate(variables):
            variable.assign(restored[group][_key(i)])


def read_variables(directory):
    """`{"model": {"00000": array, ...}, "optimizer": {...}}`: the
    variables of a checkpoint as numpy arrays, numbered in Keras' order (of
    `lm.weights` and `lm.optimizer.variables`), without a model.

    Example:

    ```python
    read_variables("runs/mhf/checkpoints/step_000300")["model"]["00000"]
    ```
    """
    ocp = _orbax()
    path = os.path.join(os.path.abspath(directory), VARIABLES)
    checkpointer = ocp.StandardCheckpointer()
    try:
        saved = checkpointer.metadata(path).item_metadata.tree
        target = {
            group: {
                key: np.zeros(meta.shape, np.dtype(meta.dtype))
                for key, meta in found.items()
            }
            for group, found in saved.items()
        }
        return checkpointer.restore(path, target)
    finally:
        checkpointer.close()


def _check_shapes(groups, saved):
    for group, variables in groups.items():
        found = saved.get(group, {})
        if len(found) != len(variables):
            raise ValueError(
                f"it holds {len(found)} {group} variables, the model has "
                f"{len(variables)}"
            )
        for i, v in enumerate(variables):
            shape = tuple(found[_key(i)].shape)
            if shape != tuple(v.shape):
                raise ValueError(
                    f"its {group} variable {i} has shape {shape}, the "
                    f"model's ({v.path}) has {tuple(v.shape)}"
                )


def _target(variable):
    """What Orbax restores a variable as: on JAX an abstract array with the
    variable's sharding, otherwise a numpy array."""
    if keras.config.backend() == "jax":
        import jax

        value = variable.value
        return jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=value.sharding
        )
    dtype = keras.backend.standardize_dtype(variable.dtype)
    return np.zeros(variable.shape, dtype)
