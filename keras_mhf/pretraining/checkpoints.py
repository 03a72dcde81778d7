"""Checkpoints of a pre-training run: directories
`OUTPUT/checkpoints/step_NNNNNN/` holding the variables (model weights and
optimizer state, written with Orbax by `checkpoint_store`, each process its
own shards) and the run state (`state.json`: step, chunk, the settings that
must not change, the size and sha256 of every file of the checkpoint, and
the sha256 of its own fields).

`RunCheckpoints` owns one run's checkpoints (one per `RunConfig`,
`RunCheckpoints.of(config)`): their folder and names, the writer, resume,
save, wait and close. A checkpoint
is written asynchronously (training goes on while it is written) under a
temporary name and renamed in one atomic step once complete; Orbax keeps the
last `KEEP_CHECKPOINTS`. `resume` loads the newest usable one after checking
its files (`read_checkpoint`); nothing non-finite is ever committed (the
values are checked while they are written). Checkpoints of keras_mhf 0.1
(`model.weights.h5`, format version 1) and of format version 2 are still
read.
"""

import math
import os
import shutil
import warnings

import keras
import numpy as np

from keras_mhf.pretraining import checkpoint_store
from keras_mhf.pretraining.checkpoint_store import STATE_DIGEST
from keras_mhf.pretraining.checkpoint_store import STATE_FILE
from keras_mhf.pretraining.checkpoint_store import TEMPORARY_MARK
from keras_mhf.pretraining.checkpoint_store import CheckpointWriter
from keras_mhf.pretraining.checkpoint_store import finite_flags_later
from keras_mhf.pretraining.checkpoint_store import state_digest
from keras_mhf.pretraining.checkpoint_store import step_name
from keras_mhf.pretraining.checkpoint_store import step_of
from keras_mhf.pretraining.config import is_primary
from keras_mhf.pretraining.config import process_layout
from keras_mhf.pretraining.errors import CheckpointError
from keras_mhf.pretraining.errors import NonFiniteLossError
from keras_mhf.pretraining.errors import NonFiniteValues
from keras_mhf.pretraining.errors import NonFiniteWeightsError
from keras_mhf.pretraining.errors import RunConfigError
from keras_mhf.pretraining.logs import trim_log
from keras_mhf.settings.run_settings import RUN_SETTINGS
from keras_mhf.settings.run_settings import part_of_run
from keras_mhf.utils.disk_space import DiskFullError
from keras_mhf.utils.disk_space import check_free_space
from keras_mhf.utils.disk_space import directory_bytes
from keras_mhf.utils.disk_space import disk_full_reason
from keras_mhf.utils.files import check_format
from keras_mhf.utils.files import read_json
from keras_mhf.utils.files import write_json

CHECKPOINTS = "checkpoints"
CHECKPOINT_FORMAT = "keras_mhf.pretraining_checkpoint"
# 3: `state.json` holds the sha256 of its own fields (2, without it, is
# still read).
CHECKPOINT_VERSION = 3
# Checkpoints of keras_mhf 0.1 (format version 1, still resumed): the
# weights in `model.weights.h5`, a LoRA run's adapters beside them.
WEIGHTS_FILE = "model.weights.h5"
LORA_FILE = "model.lora.h5"
KEEP_CHECKPOINTS = 2
_TEMPORARY_PREFIX = ".tmp-"
_UNUSABLE_SUFFIX = ".unusable"


def run_settings(config, data):
    """The settings a checkpoint must share with the run that resumes it
    (those `RUN_SETTINGS` marks `recorded`): they decide the model, the
    data of every step and the schedule's length, and for a fine-tuning run
    the preset (its sha256), the LoRA rank and whether the tables train.
    (The optimizer's learning rate, warmup and weight decay may change on
    resume, e.g. to continue a diverged run more gently.)

    Example:

    ```python
    run_settings(config, data)["batch_size"]  # == config.batch_size
    ```
    """
    from keras_mhf.pretraining.presets import preset_fingerprint

    settings = {}
    for setting in RUN_SETTINGS:
        if setting.recorded and part_of_run(setting, config.command):
            value = getattr(config, setting.name)
            if setting.recorded == "fingerprint":
                value = preset_fingerprint(value)
            settings[setting.name] = value
    return settings | {"data": data.fingerprint}


def recorded_settings(settings):
    """Settings as recorded, read as this version records them: runs of 0.1
    record `mixed_precision` (a bool) where `precision` is now, and runs
    before 0.3 accumulated no gradients (`gradient_accumulation_steps` 1)."""
    settings = dict(settings)
    if "mixed_precision" in settings and "precision" not in settings:
        mixed = settings.pop("mixed_precision")
        settings["precision"] = "mixed_bfloat16" if mixed else "float32"
    settings.setdefault("gradient_accumulation_steps", 1)
    return settings


RUN_RECORD = "run.json"


def record_run(config, data):
    """Step "record": writes the run's settings (`run_settings`) to
    `OUTPUT/run.json` on its first start, and refuses a later command on
    the same output whose settings differ, before it trains or writes
    anything (also when the first run stopped before its first checkpoint).

    Raises:
        RunConfigError: `run.json` records other settings.

    Example:

    ```python
    record_run(config, load_data(config))  # writes or checks run.json
    ```
    """
    path = config.path(RUN_RECORD)
    wanted = run_settings(config, data)
    if os.path.exists(path):
        try:
            found = recorded_settings(read_json(path)["settings"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise RunConfigError(
                f"{path} is unreadable ({error}); delete it only if "
                f"{config.output_dir} holds nothing you need, or use a new "
                "--output."
            ) from error
        if found != wanted:
            raise RunConfigError(
                f"{config.output_dir} belongs to a run with other settings ("
                + _differences(found, wanted, "recorded")
                + f"; see {path}). Rerun with those settings to "
                "resume it, or use a new --output."
            )
        return
    if is_primary():
        write_json(path, {"settings": wanted})


def _optimizer_settings(config):
    return {
        "learning_rate": config.learning_rate,
        "warmup_steps": config.warmup_steps,
        "weight_decay": config.weight_decay,
        "optimizer": config.optimizer,
    }


class RunCheckpoints:
    """The checkpoints of one run, `OUTPUT/checkpoints/step_NNNNNN/`: their
    folder, their names, the writer of the run's checkpoints
    (`checkpoint_store.CheckpointWriter`, made at the first `save`), and
    what a run does with them: `resume`, `save`, `wait`, `close`. One per
    run, kept on its `RunConfig`: `RunCheckpoints.of(config)`.

    Error messages name checkpoints by their folder names
    (`last_committed`); only `latest` (on resume) reads, checks and sets
    aside checkpoints.

    Example:

    ```python
    checkpoints = RunCheckpoints.of(config)
    step = checkpoints.resume(lm, data)
    checkpoints.save(lm, data, step + 1, validation_loss=5.2)
    checkpoints.close()
    ```
    """

    def __init__(self, config):
        self.config = config
        self.root = config.path(CHECKPOINTS)
        self._writer = None

    @classmethod
    def of(cls, config):
        """The checkpoints of the run of `config` (made on first use)."""
        if config.run_checkpoints is None:
            config.run_checkpoints = cls(config)
        return config.run_checkpoints

    def directory(self, step):
        """`OUTPUT/checkpoints/step_NNNNNN` of a global step."""
        return os.path.join(self.root, step_name(step))

    def committed(self):
        """`[(step, directory)]` of the checkpoint folders, newest first
        (complete by construction: only the commit's rename names them)."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            step, path = step_of(name), os.path.join(self.root, name)
            if step is not None and os.path.isdir(path):
                found.append((step, path))
        return sorted(found, reverse=True)

    def last_committed(self):
        """`(directory, step)` of the newest committed checkpoint, by its
        folder name, once the write in flight (if any) has ended; or
        `None`. For messages: it reads, checks and moves nothing."""
        self.wait()
        found = self.committed()
        return (found[0][1], found[0][0]) if found else None

    def latest(self):
        """`(directory, state)` of the newest usable checkpoint, or `None`.

        An unusable newer one (see `read_checkpoint`) is renamed
        `step_NNNNNN.unusable` with a warning naming it, and the previous
        one is used. When none is usable, nothing is moved and the run is
        refused, the same way on every rerun, unless
        `config.discard_unusable_checkpoints` says to set them all aside
        and train from step 0.

        Raises:
            CheckpointError: checkpoints exist but none is usable.
        """
        self.wait()
        unusable = []
        for step, directory in self.committed():
            try:
                state = read_checkpoint(directory)
            except CheckpointError as error:
                unusable.append((step, directory, error))
                continue
            _set_aside(unusable, "the previous complete checkpoint is used")
            return directory, state
        if unusable and not self.config.discard_unusable_checkpoints:
            raise CheckpointError(
                f"{self.config.output_dir} holds checkpoints, but none can be "
                "loaded: "
                + "; ".join(f"{d}: {e}" for _, d, e in unusable)
                + ". Nothing was loaded or moved. Rerun with "
                "--discard-unusable-checkpoints to set them aside and train "
                "from step 0, or use a new --output."
            )
        _set_aside(unusable, "the run trains from step 0")
        return None

    def remove_stale(self):
        """Removes the temporary folders that a killed or failed write left
        (Orbax's, and 0.1's `.tmp-*`)."""
        if not os.path.isdir(self.root) or not is_primary():
            return
        for name in os.listdir(self.root):
            if name.startswith(_TEMPORARY_PREFIX) or TEMPORARY_MARK in name:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def resume(self, lm, data):
        """Step "resume": loads the newest usable checkpoint into `lm`
        (weights and optimizer state) and returns the global step to
        continue from (0 for a new run).

        Raises:
            RunConfigError: the checkpoint belongs to a run with other
                settings (see `run_settings`), or the directory holds a
                checkpoint of an earlier keras_mhf layout.
            CheckpointError: there are checkpoints but none is usable.
        """
        config = self.config
        if os.path.exists(config.path("checkpoint.json")):
            raise RunConfigError(
                f"{config.output_dir} holds a checkpoint of an earlier "
                "keras_mhf version (checkpoint.json, checkpoint.weights.h5), "
                "which this version cannot resume; use a new --output."
            )
        self.remove_stale()
        found = self.latest()
        if found is None:
            _check_same_step_everywhere(0)
            if os.path.exists(config.path("log.csv")) and is_primary():
                os.remove(config.path("log.csv"))
            return 0
        directory, state = found
        _check_same_step_everywhere(state["step"])
        wanted = run_settings(config, data)
        recorded = recorded_settings(state["settings"])
        if recorded != wanted:
            raise RunConfigError(
                f"{config.output_dir} holds a checkpoint (step {state['step']}"
                ") of a run with different settings ("
                + _differences(recorded, wanted)
                + "). Rerun with the settings it was made with to resume it, "
                "or use a new --output."
            )
        # Checkpoints of 0.1 do not name the optimizer: Keras' AdamW.
        recorded = {"optimizer": "keras_adamw", **state["optimizer"]}
        changed = _differences(recorded, _optimizer_settings(config))
        if changed:
            warnings.warn(
                f"Resuming from step {state['step']} with other optimizer "
                f"settings ({changed}); the run is no longer the same as an "
                "uninterrupted one.",
                stacklevel=3,
            )
        lm.optimizer.build(lm.trainable_variables)
        _load(directory, state, lm)
        trim_log(config, state["step"])
        if config.verbose:
            print(f"Resuming from step {state['step']} ({directory}).")
        return state["step"]

    def save(self, lm, data, step, train_loss=None, validation_loss=None):
        """Step "checkpoint": starts writing the variables (model weights
        and optimizer state) and the run state as `step_NNNNNN/`, and
        returns its directory while it is written (`wait` waits). Older
        checkpoints are pruned once it is committed (the last
        `KEEP_CHECKPOINTS` stay). Every process calls it (each writes its
        own shards).

        Only a good checkpoint is written: finite weights and optimizer
        state (checked while they are written; in a multi-process job,
        before: a non-finite value stops the commit, and the error comes
        from the next wait) and a finite `validation_loss`. Before writing,
        the free space is checked against the size of the last checkpoint
        (or, for the first, of the variables).

        Raises:
            NonFiniteWeightsError: a weight of this checkpoint
                (multi-process) or of the previous one is NaN or infinite
                (it was not written).
            NonFiniteLossError: `validation_loss` is NaN or infinite
                (nothing is written).
            DiskFullError: the file system is (or would be) full, or it
                filled up while the previous checkpoint was written;
                temporary directories are removed and older checkpoints are
                kept.
        """
        config = self.config
        alone = process_layout()[1] == 1
        if not alone:  # the writing thread cannot run collectives: check now
            self.check_finite(lm, step, "checkpoint")
        if validation_loss is not None and not math.isfinite(validation_loss):
            raise self.non_finite_stop(
                NonFiniteLossError,
                f"the validation loss became non-finite ({validation_loss}) "
                f"at step {step} although the training loss was finite "
                f"({train_loss}); no checkpoint was written from these "
                "weights.",
                step,
            )
        if self._writer is None:
            if is_primary():
                os.makedirs(self.root, exist_ok=True)
            self._writer = CheckpointWriter(self.root, KEEP_CHECKPOINTS)
        self.wait()
        if is_primary():
            found = self.committed()
            check_free_space(
                self.root,
                directory_bytes(found[0][1])
                if found
                else variable_bytes(lm) * 11 // 10,
                f"checkpoint {step_name(step)}",
                self.resume_advice,
            )
        state = {
            "format": CHECKPOINT_FORMAT,
            "format_version": CHECKPOINT_VERSION,
            "step": step,
            "chunk": math.ceil(step / config.checkpoint_every),
            "tokens_seen": step * config.batch_size * config.sequence_length,
            "train_loss": None if train_loss is None else float(train_loss),
            "validation_loss": (
                None if validation_loss is None else float(validation_loss)
            ),
            "settings": run_settings(config, data),
            "optimizer": _optimizer_settings(config),
        }
        self._writer.save(step, lm, state, check_finite=alone)
        return self.directory(step)

    def wait(self):
        """Waits until the checkpoint being written (if any) is committed.

        Raises:
            DiskFullError: the disk filled up (or a file reached the
                file-size limit) during the write; its temporary directory
                is removed and the message names the last complete
                checkpoint.
            NonFiniteWeightsError: a value of the checkpoint was NaN or
                infinite, so it was not committed (its temporary directory
                is removed; the message names the last good checkpoint).
        """
        if self._writer is None:
            return
        step = self._writer.pending_step
        try:
            self._writer.wait()
        except Exception as error:  # Orbax re-raises the writing thread's
            non_finite = _caused_by(error, NonFiniteValues)
            full = disk_full_reason(error)
            if non_finite is None and full is None:
                raise
            self.close(wait=False)
            self.remove_stale()
            if non_finite is not None:
                raise self.non_finite_stop(
                    NonFiniteWeightsError,
                    f"the weights became non-finite by step {step} ("
                    f"{len(non_finite.paths)} variables, e.g. "
                    f"{non_finite.paths[0]}) although the training loss "
                    "stayed finite; no checkpoint was written from them.",
                    step,
                ) from None
            raise DiskFullError(
                f"{full} while writing checkpoint {step_name(step)} in "
                f"{self.root} ({str(error).splitlines()[0][:120]}); the "
                "temporary directory was removed. " + self.resume_advice()
            ) from None

    def close(self, wait=True):
        """Waits for the checkpoint being written (unless `wait=False`) and
        releases the writer (a later `save` makes a new one)."""
        try:
            if wait:
                self.wait()
        finally:
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close(wait=False)

    def resume_advice(self):
        """What to do after a full disk: the last complete checkpoint."""
        kept = self.last_committed()
        where = (
            f"The last complete checkpoint is step {kept[1]} ({kept[0]})"
            if kept
            else "No checkpoint had been written yet"
        )
        return (
            f"{where}; free space (or raise the file-size limit) and rerun "
            "the same command to resume."
        )

    def non_finite_stop(self, error_class, message, step):
        """The error that stops a diverged run (a `NonFiniteTrainingError`
        subclass): `message`, then the last good checkpoint and what to
        change."""
        kept = self.last_committed()
        if kept is None:
            where = "No checkpoint had been written yet."
        else:
            where = (
                f"The last good checkpoint (step {kept[1]}: finite weights, "
                "optimizer state and validation loss) is kept in "
                f"{kept[0]}."
            )
        return error_class(
            f"{message} {where} Rerun with a lower --learning-rate (it was "
            f"{self.config.learning_rate:g}) to resume from "
            + ("there" if kept else "the start")
            + ", or start again with a new --output.",
            step,
            kept[0] if kept else None,
        )

    def check_finite(self, lm, step, what):
        """Raises `NonFiniteWeightsError` if a model or optimizer variable
        holds NaN or infinity (no `what` is written from them)."""
        bad = _non_finite_variables(lm)
        if bad:
            raise self.non_finite_stop(
                NonFiniteWeightsError,
                f"the weights became non-finite by step {step} ({len(bad)} "
                f"variables, e.g. {bad[0]}) although the training loss "
                f"stayed finite; no {what} was written from them.",
                step,
            )


def read_checkpoint(directory):
    """The run state of a checkpoint directory, after checking it: its
    `state.json` has the sha256 of its fields that it records (format
    version 3) and the step of the folder's name, and every file it records
    has its recorded size and sha256.

    Raises:
        CheckpointError: unreadable, edited or damaged state, or files that
            are missing, truncated or damaged.

    Example:

    ```python
    read_checkpoint("runs/mhf/checkpoints/step_000300")["step"]  # 300
    ```
    """
    state_path = os.path.join(directory, STATE_FILE)
    try:
        state = read_json(state_path)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"its {STATE_FILE} is unreadable ({error})")
    check_format(
        state,
        CHECKPOINT_FORMAT,
        (1, 2, CHECKPOINT_VERSION),
        lambda: CheckpointError(f"its {STATE_FILE} is not a checkpoint state"),
        lambda found: CheckpointError(
            f"it has format version {found!r}, this keras_mhf reads 1 to "
            f"{CHECKPOINT_VERSION}"
        ),
    )
    version = state["format_version"]
    if version >= 3 and state.get(STATE_DIGEST) != state_digest(state):
        raise CheckpointError(
            f"{state_path} does not match the sha256 of its fields that it "
            "records (edited or damaged)"
        )
    named = step_of(os.path.basename(directory))
    if named is not None and state.get("step") != named:
        raise CheckpointError(
            f"{state_path} records step {state.get('step')!r}, its folder "
            f"step {named} (edited or damaged)"
        )
    if version == 1:
        files = {
            state[k]["file"]: state[k]
            for k in ("weights", "lora")
            if state.get(k) is not None
        }
    else:
        files = state["files"]
    problem = checkpoint_store.check_manifest(directory, files)
    if problem is not None:
        raise CheckpointError(problem)
    return state


def _set_aside(unusable, instead):
    """Renames each unusable checkpoint `step_NNNNNN.unusable`, with a
    warning naming it and what the run does `instead`."""
    for step, directory, error in unusable:
        aside = directory + _UNUSABLE_SUFFIX
        if is_primary():
            if os.path.exists(aside):
                shutil.rmtree(aside)
            os.replace(directory, aside)
        warnings.warn(
            f"The checkpoint {directory} (step {step}) is unusable ({error}); "
            f"it was moved to {aside} and {instead}.",
            stacklevel=3,
        )


def _differences(found, wanted, where="in the checkpoint"):
    keys = [k for k in wanted if found.get(k) != wanted[k]]
    return "; ".join(
        f"{k}: {str(found.get(k))[:16]} {where}, now {str(wanted[k])[:16]}"
        for k in keys
    )


def _load(directory, state, lm):
    """Loads a checkpoint's variables into `lm` (its optimizer built)."""
    if state["format_version"] == 1:  # keras_mhf 0.1: Keras' h5 files
        lm.load_weights(os.path.join(directory, state["weights"]["file"]))
        if state.get("lora") is not None:  # load_weights zeroed them
            lm.backbone.load_lora_weights(
                os.path.join(directory, state["lora"]["file"])
            )
        return
    try:
        checkpoint_store.restore_variables(directory, lm)
    except ValueError as error:
        raise CheckpointError(
            f"{directory} cannot be loaded into this model: {error}"
        ) from error


def _check_same_step_everywhere(step):
    """In a multi-process job, every process must resume from the same
    checkpoint (process 0 writes them; the others read them)."""
    if process_layout()[1] == 1:
        return
    from jax.experimental import multihost_utils

    steps = np.asarray(
        multihost_utils.process_allgather(np.array([step], np.int64))
    ).reshape(-1)
    if len(set(steps.tolist())) > 1:
        raise RunConfigError(
            "The processes found different checkpoints to resume from (steps "
            f"{steps.tolist()} for processes 0..{len(steps) - 1}): --output "
            "must be a directory that every process sees (a shared "
            "filesystem), since process 0 writes the checkpoints."
        )


def _non_finite_variables(lm):
    """Paths of model and optimizer variables holding NaN or infinity,
    checked where the variables live (one small result per variable comes
    back to the host; a sharded variable is checked shard by shard)."""
    variables = list(lm.weights)
    if lm.optimizer is not None:
        variables += list(lm.optimizer.variables)
    checked = [
        v
        for v in variables
        if "float" in keras.backend.standardize_dtype(v.dtype)
    ]
    if not checked:
        return []
    finite = finite_flags_later([v.value for v in checked])()
    return [v.path for v, ok in zip(checked, np.asarray(finite)) if not ok]


def _caused_by(error, kind):
    """`error`, or the exception of type `kind` it was raised from."""
    while error is not None and not isinstance(error, kind):
        error = error.__cause__ or error.__context__
    return error


def variable_bytes(lm, optimizer=True):
    """Bytes of the model's variables (and its optimizer's): an estimate of
    a checkpoint's (or, without the optimizer, a preset's) size.

    Example:

    ```python
    variable_bytes(lm)  # e.g. 2_100_000 for tiny_h4b1024 with AdamW
    ```
    """
    variables = list(lm.weights)
    if optimizer and lm.optimizer is not None:
        variables += list(lm.optimizer.variables)
    return sum(
        int(np.prod(v.shape))
        * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in variables
    )
