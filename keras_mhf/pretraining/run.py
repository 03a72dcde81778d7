"""`pretrain`: the named steps of a pre-training run, and `finish`, the step
that acts on the final model and writes its preset and summary (see the
package docstring for the whole run)."""

import json
import os
import re
import shutil
import time

from keras_mhf.pretraining import training
from keras_mhf.pretraining.checkpoints import check_finite
from keras_mhf.pretraining.checkpoints import list_checkpoints
from keras_mhf.pretraining.checkpoints import resume
from keras_mhf.pretraining.checkpoints import save_checkpoint
from keras_mhf.pretraining.config import RunConfig
from keras_mhf.pretraining.config import is_primary
from keras_mhf.pretraining.config import run_scope
from keras_mhf.pretraining.config import writing_alone
from keras_mhf.pretraining.data import load_data
from keras_mhf.pretraining.files import fsync_directory
from keras_mhf.pretraining.files import fsync_file
from keras_mhf.pretraining.files import write_atomically
from keras_mhf.pretraining.logs import plot_log
from keras_mhf.pretraining.logs import write_log_row
from keras_mhf.pretraining.validation import describe
from keras_mhf.pretraining.validation import validate_final_model
from keras_mhf.utils.keras_utils import count_trainable_parameters


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
    checkpoints = list_checkpoints(config)
    if checkpoints:
        summary["checkpoint"] = os.path.abspath(checkpoints[0][1])
    if not finished:
        return summary
    check_finite(config, lm, step, "preset or summary")
    results = validate_final_model(config, lm, data)
    summary.update(results)
    if config.verbose:
        print(describe(results))
    if not is_primary():
        return summary
    preset = config.path("preset")
    _save_preset(lm, preset)
    summary["preset"] = os.path.abspath(preset)
    plot = plot_log(config.path("log.csv"), config.path("loss.png"))
    if plot:
        summary["plot"] = os.path.abspath(plot)
    write_atomically(
        config.path("summary.json"),
        json.dumps(summary, indent=2).encode("utf-8"),
    )
    return summary


def _save_preset(lm, preset):
    """`save_to_preset` into a temporary directory, flushed, then renamed
    over `preset` (an older preset is replaced only by a complete one)."""
    parent = os.path.dirname(os.path.abspath(preset))
    stale = re.compile(re.escape(os.path.basename(preset)) + r"\.(tmp|old)-")
    for name in os.listdir(parent):  # left by a run killed while writing
        if stale.match(name):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    temporary = f"{preset}.tmp-{os.getpid()}"
    with writing_alone():
        lm.save_to_preset(temporary)
    for root, _, names in os.walk(temporary):
        for name in names:
            fsync_file(os.path.join(root, name))
    fsync_directory(temporary)
    if os.path.exists(preset):
        old = f"{preset}.old-{os.getpid()}"
        os.replace(preset, old)
        os.replace(temporary, preset)
        shutil.rmtree(old)
    else:
        os.replace(temporary, preset)
    fsync_directory(parent)


def pretrain(data, output_dir, stop_after_chunks=None, **settings):
    """Trains a MultiHashFormer (or the Standard baseline) with `model.fit`.

    Args:
        data: a prepared corpus directory (`index.json`, from
            `tools/prepare_data.py`), or raw text: a `.txt`/`.jsonl`/
            `.jsonl.gz` file, a directory of them, a glob pattern or a list,
            prepared into `output_dir/data/` first.
        output_dir: where the checkpoints (`checkpoints/`), `log.csv`,
            `loss.png`, `summary.json`, the final preset (`preset/`) and, for
            raw text, the prepared data and trained tokenizer go.
        stop_after_chunks: stop (as if killed) after this many chunks of
            this call; for testing resumption.
        **settings: the fields of `RunConfig`:
            `tokenizer` (path to a SentencePiece `.model`; if `None`: for raw
            text, one with `vocabulary_size` pieces is trained on at most
            the first `TOKENIZER_SAMPLE_DOCUMENTS` training documents /
            `TOKENIZER_SAMPLE_CHARACTERS` characters; for a prepared
            directory, the tokenizer file recorded in its `index.json`),
            `model` (`"mhf"` or `"standard"`), `architecture` (e.g.
            `"mini_h4b1024"`), `extra_layers` (Standard+kL),
            `signature_rule` (`"unique"`, `"reference"`, or `"repeated"` for
            the single-ID ablation), `sequence_length`, `batch_size`
            (global, over all devices and processes), `steps` (optimizer
            steps), `learning_rate` (peak), `warmup_steps`, `weight_decay`
            (not on norms and biases), `validation_data` (raw text only:
            held-out text; if `None`, the documents whose
            `keras_mhf.data.validation_score` is below
            `validation_fraction`), `validation_blocks` (this many held-out
            windows are scored at every checkpoint), `calibrate` (MHF: fit
            the scoring temperature on the first half of those windows at
            the end and report the second half; default `True`; the Standard
            baseline is never calibrated), `checkpoint_every`
            (steps per chunk: validation, log line and checkpoint after each),
            `workers` (tokenizer processes when preparing raw text; default
            every core), `mixed_precision` (`mixed_bfloat16` for this run),
            `seed` (seeds the weights and the training windows), `distribution`
            (`None`, `"data"` or `"model"`: all devices with
            `keras.distribution`, JAX only; other backends are refused),
            `mesh` (`(batch, model)` sizes or `"2x4"`),
            `compilation_cache` (JAX: where compiled programs are kept so
            that a resumed run starts training within seconds; `"auto"`:
            `output_dir/compilation_cache`; `None` or `"none"`: off) and
            `verbose`.

    Returns:
        `(lm, summary)`: the trained model (an MHF model with its calibrated
        scoring temperature) and the summary dict (also written to
        `summary.json` when the run finished; for a finished run it holds
        `validation`, `validation_paper_rule`, `scoring_temperature`,
        `calibration` and `validation_windows`, see
        `keras_mhf.pretraining.validation.validate_final_model`).

    Raises:
        RunConfigError: invalid settings, or data, tokenizer or checkpoint
            that do not fit them (raised before training).
        CheckpointError: checkpoints exist but none can be loaded.
        NonFiniteLossError: the training loss became NaN or infinite; the
            last finite checkpoint is kept.
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
    with run_scope(config):
        run_data = load_data(config)
        if is_primary():
            os.makedirs(config.output_dir, exist_ok=True)
        lm = training.build_run_model(config, run_data.tokenizer)
        step = resume(config, lm, run_data)
        started = time.time()
        chunks = 0
        while step < config.steps:
            if stop_after_chunks is not None and chunks >= stop_after_chunks:
                break
            last = min(
                config.steps,
                (step // config.checkpoint_every + 1) * config.checkpoint_every,
            )
            # Looked up at call time: a test replaces it to poison a chunk.
            history = training.train_chunk(config, lm, run_data, step, last)
            write_log_row(config, lm, run_data, history, last, started)
            save_checkpoint(
                config, lm, run_data, last, history.history["loss"][-1]
            )
            step, chunks = last, chunks + 1
        summary = finish(config, lm, run_data, step)
    return lm, summary
