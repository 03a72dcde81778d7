"""The variables of a checkpoint, written and read with Orbax
(`orbax-checkpoint`), on every backend.

Orbax writes each process's shards of every variable (model weights and
optimizer state) into the step's directory, asynchronously: `save` returns
once the values are copied off the devices, and training goes on while they
are written. It writes under a temporary name
(`step_NNNNNN.orbax-checkpoint-tmp-*`) and renames the directory once every
process has written its part (the atomic commit), removes temporary
directories that a killed run left, and keeps the last `keep` checkpoints.
Before the rename, process 0 adds `state.json` (the run state, the size
and sha256 of every file of the checkpoint, and the sha256 of its own
fields, `state_digest`), so that a damaged or edited file is found before a
resume trusts it.

On JAX the values are the variables' (possibly sharded) arrays, and a
restore puts each shard straight onto the current layout (also another mesh
or process count); TensorFlow and PyTorch give numpy copies. Orbax's cost on
the training thread grows with the number of arrays, so the small
replicated variables (up to `PACK_BYTES` each: most of a model's variables
by count, few of its bytes) are copied into one array per dtype (`packs`,
made where the variables live), which `state.json` maps back to the
variables (`"packed"`); large or sharded ones are written each as its own
array (`VariableLayout`). When every value written is such a copy (all of
them on TensorFlow and PyTorch; on JAX when no variable is large or
sharded) and the job has one process, even Orbax's setup of the write runs
on a writer thread: `save` returns once the copies are made.

    writer = CheckpointWriter("runs/mhf/checkpoints", keep=2)
    writer.save(100, lm, state)         # returns while the write goes on
    writer.wait()                       # the checkpoint is committed
    restore_variables("runs/mhf/checkpoints/step_000100", lm)
"""

import functools
import glob
import hashlib
import json
import math
import os
import re
import sys
import threading
import time

import keras
import numpy as np

from keras_mhf.pretraining.config import process_layout
from keras_mhf.pretraining.errors import NonFiniteValues
from keras_mhf.utils import hooks
from keras_mhf.utils.files import file_sha256
from keras_mhf.utils.files import fsync_directory
from keras_mhf.utils.files import read_json
from keras_mhf.utils.files import write_json

VARIABLES = "variables"  # the Orbax item holding the arrays
PACKS = "packs"  # its group of packed small variables
# Variables up to this size (and not split across devices) are packed: Orbax
# pays a fixed cost per array on the training thread, and a model has
# hundreds of small variables; packing copies them, so large ones are cheaper
# alone (the choice is measured in docs/scaling.md).
PACK_BYTES = 2**20
STATE_FILE = "state.json"
# The sha256 of the rest of `state.json` (`state_digest`), in it: the file
# cannot be in its own manifest, and an edited step or setting must not be
# trusted.
STATE_DIGEST = "state_sha256"
# Orbax's step metadata (commit time), rewritten at the commit, after
# `state.json`: outside the manifest.
STEP_METADATA = "_CHECKPOINT_METADATA"
STEP_PREFIX, STEP_DIGITS = "step", 6
_STEP_NAME = re.compile(rf"^{STEP_PREFIX}_(\d+)$")
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
    if all(isinstance(value, np.ndarray) for value in values):
        return lambda: np.array(
            [np.isfinite(value).all() for value in values], bool
        )
    if keras.config.backend() == "jax":
        return _read_later(_compiled(all_finite)(values))
    return lambda: np.asarray(keras.ops.convert_to_numpy(all_finite(values)))


def _read_later(flags):
    """A callable giving the jax array `flags` in numpy (gathered from
    every process when it is split across them)."""

    def read():
        if flags.is_fully_addressable:
            return np.asarray(flags)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(flags, tiled=True))

    return read


@functools.cache
def _compiled(function, *static_argnums):
    """`function` compiled (once) where the backend compiles: `jax.jit`,
    `tf.function`; as it is on PyTorch."""
    backend = keras.config.backend()
    if backend == "jax":
        import jax

        return jax.jit(function, static_argnums=static_argnums)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(function)  # (Python arguments are static)
    return function


def _packs_on_device(packs, check):
    """`(flats, flags)`: each list of tensors of `packs` concatenated
    into one flat array, and (with `check`, else none) `all_finite` of the
    float values of the packs, in order. Compiled as one program
    (`_compiled(_packs_on_device, 1)`)."""
    flats = [
        keras.ops.concatenate([keras.ops.reshape(v, (-1,)) for v in pack])
        for pack in packs
    ]
    checked = [
        value
        for pack in packs
        for value in pack
        if check and "float" in keras.backend.standardize_dtype(value.dtype)
    ]
    if not checked:
        return flats, keras.ops.zeros((0,), "bool")
    return flats, all_finite(checked)


def step_name(step):
    """The name of a step's checkpoint folder (Orbax's): `step_000123`."""
    return f"{STEP_PREFIX}_{step:0{STEP_DIGITS}d}"


def step_of(name):
    """The step of a checkpoint folder's name, or `None` for another name
    (a temporary or set-aside folder)."""
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def _key(index):
    return f"{index:05d}"


class VariableLayout:
    """Where a model's variables go in a checkpoint: fixed by their
    shapes, dtypes and placements, so a writer works it out once.

    The variables (the model's and its optimizer's, `_groups` order) are
    numbered in Keras' order per group (`"00003"`). The small ones that
    every device holding them holds whole (at most `PACK_BYTES`) are
    concatenated into one pack per dtype and placement; the others are
    written each as its own array.

    Example:

    ```python
    layout = VariableLayout(lm)
    tree, check = layout.snapshot(check_finite=True)
    ```
    """

    def __init__(self, lm):
        jax = keras.config.backend() == "jax"
        groups = _groups(lm)
        self.variables = [v for vs in groups.values() for v in vs]
        self.keys = [
            (group, _key(i))
            for group, vs in groups.items()
            for i in range(len(vs))
        ]
        members, self.singles = {}, []
        for at, variable in enumerate(self.variables):
            dtype = keras.backend.standardize_dtype(variable.dtype)
            sharding = variable.value.sharding if jax else None
            nbytes = math.prod(variable.shape) * np.dtype(dtype).itemsize
            replicated = sharding is None or sharding.is_fully_replicated
            if replicated and nbytes <= PACK_BYTES:
                members.setdefault((dtype, sharding), []).append(at)
            else:
                self.singles.append(at)
        self.packs = list(members.values())
        # Whether every value written is a copy (see `snapshot`): then even
        # the hand-off to Orbax can run off the training thread.
        self.copies = keras.config.backend() != "jax" or not self.singles
        # `{"float32_0": [[group, key, shape], ...]}`, for `state.json`.
        self.packed = {
            f"{dtype}_{n}": [
                [*self.keys[at], list(self.variables[at].shape)] for at in pack
            ]
            for n, ((dtype, _), pack) in enumerate(members.items())
        }
        floating = [
            "float" in keras.backend.standardize_dtype(v.dtype)
            for v in self.variables
        ]
        # The float variables (finite-checked), in the flags' order: the
        # packs' values, then the others.
        self.checked_packed = [
            at for pack in self.packs for at in pack if floating[at]
        ]
        self.checked_singles = [at for at in self.singles if floating[at]]
        self.checked = self.checked_packed + self.checked_singles
        self.paths = [self.variables[at].path for at in self.checked]
        self._buffers = {}  # the packs' memory on PyTorch, reused

    def matches(self, lm):
        """Whether `lm`'s variables are those of this layout."""
        variables = [v for vs in _groups(lm).values() for v in vs]
        return len(variables) == len(self.variables) and all(
            a is b for a, b in zip(variables, self.variables)
        )

    def snapshot(self, check_finite=False):
        """`(tree, check)`: what a checkpoint writes of the variables now.

        `tree` is `{"model": {"00003": value, ...}, "optimizer": {...},
        "packs": {"float32_0": flat array, ...}}`. Nothing in it is a
        variable's own memory: the training goes on while it is written. On
        JAX and TensorFlow the packs are made where the variables live by
        one compiled program (on JAX it also checks their values); on
        PyTorch (eager) in numpy, in memory reused by the next snapshot (a
        writer waits for the last write first). On JAX the packs and the
        other values stay jax arrays (the others are the variables' own,
        sharded as they are: Orbax copies them off the devices before `save`
        returns); on TensorFlow and PyTorch they are numpy arrays (the others
        copies).

        With `check_finite`, `check` is `(flags, paths)`: `flags()` (see
        `finite_flags_later`) tells which of the float variables `paths`
        hold only finite values in what is written; else `None`.
        """
        backend = keras.config.backend()
        jax = backend == "jax"
        values = [v.value for v in self.variables]
        if backend == "torch":  # eager: numpy is faster
            values = [keras.ops.convert_to_numpy(value) for value in values]
            flats = [
                _concatenate([values[at] for at in pack], self._buffers, n)
                for n, pack in enumerate(self.packs)
            ]
        else:
            packs = [[values[at] for at in pack] for pack in self.packs]
            check = check_finite and jax
            flats, flags = _compiled(_packs_on_device, 1)(packs, check)
            if not jax:
                flats = [keras.ops.convert_to_numpy(flat) for flat in flats]
                for at in self.singles:
                    values[at] = keras.ops.convert_to_numpy(values[at])
        if not jax:
            for pack, entries, flat in zip(
                self.packs, self.packed.values(), flats
            ):
                for at, view in zip(pack, _unpack(flat, entries)):
                    values[at] = view
            for at in self.singles:  # (numpy may share a variable's memory)
                values[at] = np.array(values[at], copy=True)
        tree = {}
        for at in self.singles:
            group, key = self.keys[at]
            tree.setdefault(group, {})[key] = values[at]
        if flats:
            tree[PACKS] = dict(zip(self.packed, flats))
        if not check_finite:
            return tree, None
        if jax:
            in_packs = _read_later(flags)
        else:
            in_packs = finite_flags_later(
                [values[at] for at in self.checked_packed]
            )
        # A program of its own: the packs are ready (to be written) before
        # the check of the large values is done.
        others = finite_flags_later([values[at] for at in self.checked_singles])
        flags = lambda: np.concatenate([in_packs(), others()])  # noqa: E731
        return tree, (flags, self.paths)


def _concatenate(values, buffers, n):
    """`values` (numpy) flattened into one array: `buffers[n]`, reused when
    it has the size and dtype (fresh memory costs page faults)."""
    size = sum(value.size for value in values)
    buffer = buffers.get(n)
    if buffer is None or buffer.size != size or buffer.dtype != values[0].dtype:
        buffer = buffers[n] = np.empty(size, values[0].dtype)
    return np.concatenate([value.reshape(-1) for value in values], out=buffer)


def _unpack(flat, entries):
    """The values of a pack's variables (`entries` as in `packed`)."""
    offset = 0
    for _, _, shape in entries:
        size = math.prod(shape)
        yield flat[offset : offset + size].reshape(shape)
        offset += size


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


def state_digest(state):
    """The sha256 of a run state's fields (canonical JSON: sorted keys, no
    spaces), `STATE_DIGEST` left out.

    Example:

    ```python
    state_digest({"step": 3}) == state_digest({"step": 3, "state_sha256": 0})
    ```
    """
    fields = {k: v for k, v in state.items() if k != STATE_DIGEST}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


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


# `sys.unraisablehook` while a writer is open (`_quiet_closed_loops`).
_HOOK = {"writers": 0, "failed": False, "previous": None}


def _closed_loop_filter(unraisable):
    """Drops the one secondary error of a failed write: Orbax runs a
    write's TensorStore operations in an event loop that it closes at the
    first failure; the others end later, and TensorStore's threads report
    that they cannot call back into the closed loop (`RuntimeError: Event
    loop is closed`, with no object). Everything else goes on to the
    previous hook."""
    if unraisable.object is None and (
        isinstance(unraisable.exc_value, RuntimeError)
        and str(unraisable.exc_value) == "Event loop is closed"
    ):
        return
    _HOOK["previous"](unraisable)


def _quiet_closed_loops(opened):
    """Counts open writers (`opened` is +1 or -1) and keeps
    `_closed_loop_filter` installed while one is open, and for the rest of
    the process once a write failed (its operations may end at any later
    time)."""
    _HOOK["writers"] += opened
    installed = sys.unraisablehook is _closed_loop_filter
    if _HOOK["writers"] > 0 and not installed:
        _HOOK["previous"], sys.unraisablehook = (
            sys.unraisablehook,
            _closed_loop_filter,
        )
    elif installed and _HOOK["writers"] == 0 and not _HOOK["failed"]:
        sys.unraisablehook = _HOOK["previous"]


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
        self._starter = None  # the thread that hands a write to Orbax
        self._start_error = None
        self._layout = None  # of the model last written
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
        self._open = True
        _quiet_closed_loops(+1)

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
        if self._layout is None or not self._layout.matches(lm):
            self._layout = VariableLayout(lm)
        tree, check = self._layout.snapshot(check_finite)
        state = dict(state, packed=self._layout.packed)
        self._pending = (step, state, check)
        args = ocp.args.Composite(**{VARIABLES: ocp.args.StandardSave(tree)})
        if self._layout.copies and process_layout()[1] == 1:
            # Nothing the training touches is written: even Orbax's setup
            # runs off the training thread. (A multi-process job starts it here: its barriers
            # must run in the same order on every process.)
            self._starter = threading.Thread(
                target=self._start, args=(step, args), name="checkpoint"
            )
            self._starter.start()
        else:
            self._manager.save(step, args=args, force=True)
        hooks.event("checkpoint_started", path=self.directory(step))

    def _start(self, step, args):
        # Lets the training thread have the GIL back first (else it waits
        # up to the interpreter's switch interval to return).
        time.sleep(0)
        try:
            self._manager.save(step, args=args, force=True)
        except BaseException as error:  # raised by `wait`
            self._start_error = error

    def _join_starter(self):
        """Waits for the thread handing a write to Orbax; raises what it
        raised."""
        if self._starter is None:
            return
        self._starter.join()
        self._starter, error, self._start_error = None, self._start_error, None
        if error is not None:
            _HOOK["failed"] = True
            raise error

    def directory(self, step):
        return os.path.join(self.root, step_name(step))

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
        state[STATE_DIGEST] = state_digest(state)
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
            try:
                self._join_starter()
            finally:
                self._manager.wait_until_finished()
        except BaseException:
            _HOOK["failed"] = True
            raise
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
            try:
                self._join_starter()
            finally:
                self._manager.close()
                if self._open:
                    self._open = False
                    _quiet_closed_loops(-1)


def restore_variables(directory, lm):
    """Loads the variables of the checkpoint `directory` into `lm` (its
    optimizer built): on JAX each shard goes straight onto the variable's
    current layout.

    Raises:
        ValueError: the checkpoint's variables are not the model's (names
            the first that differs).
    """
    groups = _groups(lm)

    def target(group, key, meta):
        if group == PACKS:  # read whole by every process
            return np.zeros(meta.shape, np.dtype(meta.dtype))
        return _target(groups[group][int(key)])

    values = _read(
        directory, target, lambda saved: _check_shapes(groups, saved)
    )
    for group, variables in groups.items():
        for i, variable in enumerate(variables):
            variable.assign(_placed(values[group][_key(i)], variable))


def read_variables(directory):
    """`{"model": {"00000": array, ...}, "optimizer": {...}}`: the
    variables of a checkpoint as numpy arrays, numbered in Keras' order (of
    `lm.weights` and `lm.optimizer.variables`), without a model.

    Example:

    ```python
    read_variables("runs/mhf/checkpoints/step_000300")["model"]["00000"]
    ```
    """
    return _read(
        directory,
        lambda group, key, meta: np.zeros(meta.shape, np.dtype(meta.dtype)),
        lambda saved: None,
    )


def _read(directory, target, check):
    """`{group: {key: value}}` of a checkpoint, its packs unpacked:
    `check(shapes)` first sees `{group: {key: shape}}`, then Orbax reads
    each array as `target(group, key, metadata)`."""
    ocp = _orbax()
    path = os.path.join(os.path.abspath(directory), VARIABLES)
    packed = read_json(os.path.join(directory, STATE_FILE)).get("packed", {})
    checkpointer = ocp.StandardCheckpointer()
    try:
        saved = checkpointer.metadata(path).item_metadata.tree
        if set(saved.get(PACKS, {})) != set(packed):
            raise ValueError(
                f"its packs {sorted(saved.get(PACKS, {}))} are not those its "
                f"{STATE_FILE} maps ({sorted(packed)})"
            )
        shapes = {}
        for group, found in saved.items():
            if group == PACKS:
                continue
            for key, meta in found.items():
                shapes.setdefault(group, {})[key] = tuple(meta.shape)
        for name, entries in packed.items():
            size = sum(math.prod(shape) for _, _, shape in entries)
            if tuple(saved[PACKS][name].shape) != (size,):
                raise ValueError(
                    f"its pack {name} has shape {saved[PACKS][name].shape}, "
                    f"its {STATE_FILE} maps {size} values into it"
                )
            for group, key, shape in entries:
                shapes.setdefault(group, {})[key] = tuple(shape)
        check(shapes)
        restored = checkpointer.restore(
            path,
            {
                group: {
                    key: target(group, key, meta) for key, meta in found.items()
                }
                for group, found in saved.items()
            },
        )
    finally:
        checkpointer.close()
    values = {group: {} for group in shapes}
    for group, found in restored.items():
        if group != PACKS:
            values[group].update(found)
    for name, entries in packed.items():
        unpacked = _unpack(np.asarray(restored[PACKS][name]), entries)
        for (group, key, _), value in zip(entries, unpacked):
            values[group][key] = value
    return {
        group: dict(sorted(found.items())) for group, found in values.items()
    }


def _check_shapes(groups, saved):
    """`saved`: `{group: {key: shape}}` of a checkpoint."""
    for group, variables in groups.items():
        found = saved.get(group, {})
        numbered = [_key(i) for i in range(len(variables))]
        if sorted(found) != numbered:
            raise ValueError(
                f"it holds {len(found)} {group} variables, the model has "
                f"{len(variables)}"
            )
        for i, v in enumerate(variables):
            shape = found[_key(i)]
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


def _placed(value, variable):
    """`value` where `variable` lives: a numpy value (of a pack) is put
    onto the variable's current sharding on JAX (each process its
    shards)."""
    if keras.config.backend() != "jax" or not isinstance(value, np.ndarray):
        return value
    import jax

    sharding = variable.value.sharding
    return jax.make_array_from_callback(
        value.shape, sharding, lambda index: value[index]
    )
