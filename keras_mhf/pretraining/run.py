"""`pretrain`: the named steps of a pre-training run, and `finish`, the step
that acts on the final model and writes its preset and summary (see the
package docstring for the whole run)."""

import contextlib
import gc
import os
import re
import shutil
import time
import warnings

from keras_mhf.pretraining import training
from keras_mhf.pretraining.checkpoints import RunCheckpoints
from keras_mhf.pretraining.checkpoints import record_run
from keras_mhf.pretraining.checkpoints import variable_bytes
from keras_mhf.pretraining.config import RunConfig
from keras_mhf.pretraining.config import check_devices
from keras_mhf.pretraining.config import is_primary
from keras_mhf.pretraining.config import run_scope
from keras_mhf.pretraining.config import tensorboard_directory
from keras_mhf.pretraining.config import writing_alone
from keras_mhf.pretraining.data import load_data
from keras_mhf.pretraining.distribution import whole_weights
from keras_mhf.pretraining.errors import RunConfigError
from keras_mhf.pretraining.logs import plot_log
from keras_mhf.pretraining.logs import write_log_row
from keras_mhf.pretraining.training_curves import open_curves
from keras_mhf.pretraining.training_curves import write_validation_point
from keras_mhf.pretraining.validation import describe
from keras_mhf.pretraining.validation import initial_validation
from keras_mhf.pretraining.validation import validate_final_model
from keras_mhf.pretraining.validation import validate_initial_model
from keras_mhf.settings.settings_file import CONFIG_FILE
from keras_mhf.settings.settings_file import write_settings_file
from keras_mhf.utils import hooks
from keras_mhf.utils.disk_space import DiskFullError
from keras_mhf.utils.disk_space import check_free_space
from keras_mhf.utils.disk_space import disk_full_reason
from keras_mhf.utils.disk_space import is_disk_full
from keras_mhf.utils.files import fsync_directory
from keras_mhf.utils.files import fsync_file
from keras_mhf.utils.files import write_json
from keras_mhf.utils.keras_utils import count_trainable_parameters
from keras_mhf.utils.output_lock import LOCK_FILE
from keras_mhf.utils.output_lock import output_lock


def finish(config, lm, data, step):
    """Step "finish": for a run that reached `config.steps`, calibrates the
    scoring temperature of an MHF model (`config.calibrate`; on the first
    half of the validation windows) and scores the second half
    (`keras_mhf.pretraining.validation.validate_final_model`), then writes
    the preset (atomically, with the temperature), `summary.json` and
    `loss.png`, and returns the summary (without them for an unfinished
    run).

    It runs after the last checkpoint and changes no weight: checkpoints and
    `log.csv` are those of an uncalibrated run. Rerunning a finished run
    loads its last checkpoint and calibrates again on the same windows, to
    the same temperature.

    Example:

    ```python
    summary = finish(config, lm, data, step=config.steps)
    summary["preset"]  # "runs/mhf/preset"
    ```
    """
    finished = step >= config.steps
    summary = {
        "status": "finished" if finished else "incomplete",
        "model": config.model,
        "architecture": config.architecture,
        "parameters": count_trainable_parameters(lm),
        "train_tokens_available": data.corpus.num_tokens("train"),
        "tokens_seen": step * config.batch_size * config.sequence_length,
        "step": step,
        "steps": config.steps,
        "finished": finished,
        "data": os.path.abspath(data.corpus.directory),
        "tokenizer": os.path.abspath(data.tokenizer_path),
        "log": os.path.abspath(config.path("log.csv")),
    }
    run_checkpoints = RunCheckpoints.of(config)
    checkpoints = run_checkpoints.committed()
    if checkpoints:
        summary["checkpoint"] = os.path.abspath(checkpoints[0][1])
        summary["last_good_step"] = checkpoints[0][0]
    if not finished:
        summary["reason"] = (
            f"stopped at step {step} of {config.steps}; rerun the same "
            "command to resume"
        )
        return summary
    run_checkpoints.check_finite(lm, step, "preset or summary")
    results = validate_final_model(config, lm, data)
    summary.update(results)
    if config.initial_preset is not None:  # fine-tuning: the preset's too
        summary.update(
            initial_preset=os.path.abspath(config.initial_preset),
            lora_rank=config.lora_rank,
            train_tables=bool(config.train_tables),
            before=initial_validation(config),
        )
    if config.verbose:
        print(describe(results))
    with whole_weights(lm):  # every process takes part in the gathering
        if not is_primary():
            return summary
        preset = config.path("preset")
        save_preset(lm, preset)
    summary["preset"] = os.path.abspath(preset)
    plot = plot_log(config.path("log.csv"), config.path("loss.png"))
    if plot:
        summary["plot"] = os.path.abspath(plot)
    return summary


def save_preset(lm, preset):
    """`save_to_preset` into a temporary directory, flushed, then renamed
    over `preset` (an older preset is replaced only by a complete one).

    Example:

    ```python
    save_preset(lm, "runs/mhf/preset")
    ```

    Raises:
        DiskFullError: the file system is (or would be) full; the temporary
            directory is removed and an older preset is kept.
    """
    parent = os.path.dirname(os.path.abspath(preset))
    stale = re.compile(re.escape(os.path.basename(preset)) + r"\.(tmp|old)-")
    for name in os.listdir(parent):  # left by a run killed while writing
        if stale.match(name):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    advice = (
        "The checkpoints are complete; free space and rerun the same command "
        "to write the preset from the last one."
    )
    check_free_space(
        parent, variable_bytes(lm, optimizer=False), "the preset", advice
    )
    temporary = f"{preset}.tmp-{os.getpid()}"
    problem = None
    try:
        with writing_alone():
            lm.save_to_preset(temporary)
        for root, _, names in os.walk(temporary):
            for name in names:
                fsync_file(os.path.join(root, name))
        fsync_directory(temporary)
    except OSError as error:
        if not is_disk_full(error):
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        problem = str(error).splitlines()[0]
        full = disk_full_reason(error)
    if problem is not None:
        gc.collect()  # frees the failed write's files here, not at exit
        shutil.rmtree(temporary, ignore_errors=True)
        raise DiskFullError(
            f"{full} while writing the preset {preset} "
            f"({problem[:120]}); the temporary directory was removed. " + advice
        )
    if os.path.exists(preset):
        old = f"{preset}.old-{os.getpid()}"
        os.replace(preset, old)
        os.replace(temporary, preset)
        shutil.rmtree(old)
    else:
        os.replace(temporary, preset)
    fsync_directory(parent)


def _write_summary(config, summary):
    """`summary.json`, atomically; a failure to write it (e.g. a full disk)
    is reported as a warning, so it never hides the run's own error."""
    try:
        write_json(config.path("summary.json"), summary, indent=2)
    except OSError as error:
        warnings.warn(
            f"Could not write {config.path('summary.json')}: {error}",
            stacklevel=2,
        )


def _failure_summary(config, error):
    """The summary of a run that stopped on an error or a signal: status,
    reason, and the last good checkpoint (the one a rerun resumes from)."""
    interrupted = isinstance(error, (KeyboardInterrupt, SystemExit))
    reason = str(error).strip() or type(error).__name__
    if isinstance(error, SystemExit):
        reason = f"stopped by a signal or exit (exit status {error.code})"
    summary = {
        "status": "interrupted" if interrupted else "failed",
        "reason": reason,
        "error": type(error).__name__,
        "model": config.model,
        "architecture": config.architecture,
        "steps": config.steps,
        "finished": False,
        "last_good_step": None,
        "checkpoint": None,
    }
    try:
        checkpoints = RunCheckpoints.of(config).committed()
    except OSError:
        checkpoints = []
    if checkpoints:
        summary["last_good_step"] = checkpoints[0][0]
        summary["checkpoint"] = os.path.abspath(checkpoints[0][1])
    summary["log"] = os.path.abspath(config.path("log.csv"))
    return summary


def pretrain(data, output_dir, callbacks=None, **settings):
    """Trains a MultiHashFormer (or the Standard baseline) with `model.fit`.

    Args:
        data: a prepared corpus directory (`index.json`, from
            `keras-mhf prepare`), or raw text: a `.txt`/`.jsonl`/
            `.jsonl.gz` file, a directory of them, a glob pattern or a list,
            prepared into `output_dir/data/` first.
        output_dir: where the checkpoints (`checkpoints/`), `log.csv`,
            `loss.png`, `summary.json`, the final preset (`preset/`) and, for
            raw text, the prepared data and trained tokenizer go.
        callbacks: Keras callbacks for training, passed to `fit` with the
            run's own: `fit` is called once per chunk of `checkpoint_every`
            optimizer steps (so `on_train_begin`/`on_train_end` come once per
            chunk, and batch numbers count from 0 in each), with
            `gradient_accumulation_steps` batches per optimizer step. Not a
            setting: a settings file cannot give them.
        **settings: the fields of `RunConfig` (its docstring describes
            each; `keras_mhf.settings.RUN_SETTINGS` declares them). A
            settings file gives them too:
            `pretrain(**read_settings_file("paper.toml"))`.

    The run holds an exclusive lock on `output_dir` (a second run on it is
    refused, naming the first; the lock dies with the process), records
    the settings a resume must match in `run.json` (a later command with
    other settings is refused) and all of its resolved settings in
    `config.toml` (`keras-mhf pretrain --config OUTPUT/config.toml` reruns
    it), and, unless it is refused before training (`RunConfigError`,
    which writes nothing), writes `summary.json` however it ends: `status`
    is `"finished"`, `"incomplete"` (stopped early),
    `"failed"` (an error: `reason`, `error`) or `"interrupted"` (Ctrl-C,
    SIGTERM), with `last_good_step` and `checkpoint`, the checkpoint a
    rerun resumes from. A `keras_mhf.utils.hooks.event` hook that raises
    `hooks.Stop` at `"chunk_start"` ends the run there, as `"incomplete"`
    (tests of resumption use it).

    Returns:
        `(lm, summary)`: the trained model (an MHF model with its calibrated
        scoring temperature) and the summary dict (also `summary.json`; for
        a finished run it holds `validation`, `validation_paper_rule`,
        `scoring_temperature`, `calibration` and `validation_windows`, see
        `keras_mhf.pretraining.validation.validate_final_model`).

    Raises:
        RunConfigError: invalid settings, or data, tokenizer or checkpoint
            that do not fit them (raised before training).
        CheckpointError: checkpoints exist but none can be loaded.
        NonFiniteLossError: the training or validation loss became NaN or
            infinite; the last good checkpoint is kept.
        DiskFullError: the output's file system is full (one-line message
            naming what was being written and the last complete checkpoint).
        OutputLockedError: another process is writing to `output_dir`.
        NonFiniteWeightsError: a weight became non-finite.

    Example:

    ```python
    lm, summary = keras_mhf.pretraining.pretrain(
        "corpus.txt", "runs/mhf", architecture="tiny_h3b512", steps=100
    )
    ```
    """
    config = RunConfig(data=data, output_dir=output_dir, **settings)
    config.validate()
    distribution = check_devices(config)
    with contextlib.ExitStack() as stack:
        if is_primary():  # only process 0 writes
            stack.enter_context(
                output_lock(
                    config.output_dir,
                    "a fine-tuning run"
                    if config.initial_preset is not None
                    else "a pre-training run",
                )
            )
        # Taken under the lock: what a refused run may remove is only what
        # it wrote itself, never another run's.
        existing = _entries(config.output_dir) - {LOCK_FILE}
        guard = stack.enter_context(training.StopOnSignal().installed())
        try:
            lm, summary = _run(config, distribution, guard, callbacks or ())
        except BaseException as error:
            # A run refused for its settings or data (raised before
            # training) writes nothing; every other exit is summarised.
            if is_primary() and not isinstance(error, RunConfigError):
                _write_summary(config, _failure_summary(config, error))
            elif is_primary():  # refused: remove what this call created
                _remove_new_entries(config.output_dir, existing)
            if is_disk_full(error):
                raise DiskFullError(
                    f"{disk_full_reason(error)} while writing to "
                    f"{config.output_dir} ({str(error).splitlines()[0]}); "
                    "free space and rerun the same command to resume from "
                    "the last complete checkpoint."
                ) from None
            raise
        if is_primary():
            _write_summary(config, summary)
    return lm, summary


def _entries(directory):
    """The names in `directory` (none if it does not exist)."""
    return set(os.listdir(directory)) if os.path.isdir(directory) else set()


def _remove_new_entries(directory, existing):
    """Removes what a refused run wrote to `directory` (the names not in
    `existing`, e.g. `data/` and `run.json`), so that the corrected command
    starts afresh; the lock file goes when the lock is released."""
    for name in _entries(directory) - existing - {LOCK_FILE}:
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def _train(config, guard, callbacks):
    """Steps "data" to "checkpoint" (see the package docstring): `(lm,
    the run's data, the step reached)`."""
    run_data = load_data(config)
    if is_primary():
        os.makedirs(config.output_dir, exist_ok=True)
    record_run(config, run_data)
    if is_primary():  # what `--config OUTPUT/config.toml` reruns
        write_settings_file(config.path(CONFIG_FILE), config, config.command)
    lm = training.build_run_model(config, run_data.tokenizer)
    checkpoints = RunCheckpoints.of(config)
    step = checkpoints.resume(lm, run_data)
    validate_initial_model(config, lm, run_data, step)  # a preset's
    directory = tensorboard_directory(config)
    with contextlib.ExitStack() as stack:
        curves = None
        if directory is not None and is_primary() and step < config.steps:
            curves = open_curves(directory, step)
            stack.callback(curves.close)
        step = _train_chunks(
            config, lm, run_data, step, guard, callbacks, curves
        )
    return lm, run_data, step


def _train_chunks(config, lm, run_data, step, guard, callbacks, curves):
    """Step "one chunk", "log" and "checkpoint" until `config.steps` (or a
    hook's stop); returns the step reached. `guard` (`StopOnSignal`) ends
    the run at a signal, whatever swallowed its exception."""
    checkpoints = RunCheckpoints.of(config)
    started = time.time()
    chunks = 0
    callbacks = [guard, *callbacks]
    while step < config.steps:
        guard.check()
        try:
            hooks.event("chunk_start", step=step, chunks=chunks)
        except hooks.Stop:
            break
        last = min(
            config.steps,
            (step // config.checkpoint_every + 1) * config.checkpoint_every,
        )
        # Looked up at call time: a test replaces it to poison a chunk.
        history = training.train_chunk(
            config, lm, run_data, step, last, callbacks, curves
        )
        guard.check()  # before anything of this chunk is written
        row = write_log_row(config, lm, run_data, history, last, started)
        guard.check()
        if curves is not None:  # on disk before the checkpoint commits
            write_validation_point(curves, row)
            curves.flush()
        checkpoints.save(
            lm,
            run_data,
            last,
            history.history["loss"][-1],
            validation_loss=row["val_loss"],
        )
        step, chunks = last, chunks + 1
    return step


def _run(config, distribution, guard, callbacks):
    """The steps of `pretrain` (see the package docstring), under the
    output's lock; returns `(lm, summary)`."""
    checkpoints = RunCheckpoints.of(config)
    with run_scope(config, distribution):
        try:
            lm, run_data, step = _train(config, guard, callbacks)
            # Every checkpoint is committed before the final steps.
            checkpoints.close()
        except BaseException:
            # The checkpoint being written is a good one: it is committed
            # (the summary names it) before the error goes on.
            with contextlib.suppress(Exception):
                checkpoints.close()
            raise
        summary = finish(config, lm, run_data, step)
    return lm, summary
