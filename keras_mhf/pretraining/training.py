"""Training of a pre-training run: the model and its optimizer, and one
`fit` call per chunk of optimizer steps over windows streamed from the
prepared corpus (`train_chunk`), stopped at the first non-finite loss.

`make_optimizer`, `build_model`, `fit_blocks` and `data_order` are also used
on their own (e.g. by `recipes/expand_vocabulary.py`).
"""

import contextlib
import math
import signal
import sys
import threading

import keras
import numpy as np

from keras_mhf.data import blocks_to_features
from keras_mhf.data import window_dataset
from keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm import (
    MultiHashFormerCausalLM,
)
from keras_mhf.models.standard.standard_causal_lm import standard_causal_lm
from keras_mhf.optimizers import BiasCorrectedAdamW
from keras_mhf.optimizers import OptimizerStepSchedule
from keras_mhf.pretraining.checkpoints import RunCheckpoints
from keras_mhf.pretraining.config import is_primary
from keras_mhf.pretraining.config import process_layout
from keras_mhf.pretraining.errors import NonFiniteLossError
from keras_mhf.pretraining.presets import load_initial_model
from keras_mhf.pretraining.training_curves import TrainingCurves
from keras_mhf.settings.rules import OPTIMIZERS
from keras_mhf.utils import hooks
from keras_mhf.utils.progress import Progress


def make_optimizer(
    learning_rate,
    total_steps,
    warmup_steps,
    weight_decay=0.1,
    name="adamw",
    gradient_accumulation_steps=1,
):
    """AdamW, linear warmup then cosine decay to 0, global-norm clipping 1.0,
    weight decay on kernels and tables only (not on norms or biases): the
    authors' recipe. `name`: `"adamw"` adds epsilon after bias correction
    (`keras_mhf.optimizers.BiasCorrectedAdamW`, as `torch.optim.AdamW`);
    `"keras_adamw"` is Keras' `AdamW` (epsilon before the correction, our
    runs before 0.2).

    `gradient_accumulation_steps=N > 1`: each call of the optimizer is one
    micro-batch; every `N`th applies the mean of the `N` gradients, clipped
    as a whole, with one weight decay (Keras' own accumulation), and the
    schedule counts optimizer steps (`OptimizerStepSchedule`): one step of
    `N` micro-batches of `b` windows is one step of `N * b` windows.

    Example:

    ```python
    optimizer = make_optimizer(2e-3, total_steps=300, warmup_steps=30)
    ```
    """
    schedule = learning_rate_schedule(learning_rate, total_steps, warmup_steps)
    if name not in OPTIMIZERS:
        raise ValueError(
            f"Unknown optimizer {name!r}: use one of {sorted(OPTIMIZERS)}."
        )
    if gradient_accumulation_steps > 1:
        schedule = OptimizerStepSchedule(schedule, gradient_accumulation_steps)
    kind = BiasCorrectedAdamW if name == "adamw" else keras.optimizers.AdamW
    optimizer = kind(
        learning_rate=schedule,
        gradient_accumulation_steps=gradient_accumulation_steps
        if gradient_accumulation_steps > 1
        else None,
        weight_decay=weight_decay,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-8,
        global_clipnorm=1.0,
    )
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
    return optimizer


def learning_rate_schedule(learning_rate, total_steps, warmup_steps):
    """Linear warmup from 0 to `learning_rate`, then cosine decay to 0 at
    `total_steps`, over optimizer steps (0-based: step `t`'s update uses
    `schedule(t)`); a warmup as long as the run is shortened to
    `total_steps - 1` steps.

    Example:

    >>> schedule = learning_rate_schedule(1e-3, total_steps=100, warmup_steps=10)
    >>> round(float(keras.ops.convert_to_numpy(schedule(10))), 6)
    0.001
    """
    warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        decay_steps=max(total_steps - warmup_steps, 1),
        warmup_target=learning_rate,
        warmup_steps=warmup_steps,
        alpha=0.0,
    )


def build_model(
    kind,
    tokenizer,
    architecture,
    sequence_length,
    extra_layers=0,
    signature_rule="unique",
    rematerialize=False,
):
    """A new MHF (`kind="mhf"`) or Standard (`"standard"`) causal LM
    (`rematerialize`: see `MultiHashFormerBackbone`).

    Example:

    ```python
    lm = build_model("mhf", tokenizer, "tiny_h3b512", sequence_length=128)
    ```
    """
    if kind == "mhf":
        return MultiHashFormerCausalLM.from_tokenizer(
            tokenizer,
            architecture,
            sequence_length=sequence_length,
            signature_rule=signature_rule,
            rematerialize=rematerialize,
        )
    if kind == "standard":
        return standard_causal_lm(
            tokenizer,
            architecture,
            extra_layers=extra_layers,
            sequence_length=sequence_length,
            rematerialize=rematerialize,
        )
    raise ValueError(f"--model must be 'mhf' or 'standard'; got {kind!r}.")


def fit_blocks(lm, blocks, batch_size, verbose=1):
    """One `fit` pass over packed `[n, L+1]` blocks, in the given order.

    Example:

    ```python
    fit_blocks(lm, pack_documents(texts, sp.encode, 1, 128), batch_size=8)
    ```
    """
    x, y, sample_weight = blocks_to_features(blocks)
    preprocessor = lm.preprocessor
    lm.preprocessor = None  # the blocks are already token ids
    try:
        return lm.fit(
            x,
            y,
            sample_weight=sample_weight,
            batch_size=batch_size,
            epochs=1,
            shuffle=False,
            verbose=verbose,
        )
    finally:
        lm.preprocessor = preprocessor


def data_order(num_blocks, total_samples, seed):
    """Sample indices for a whole run over in-memory blocks: shuffled
    passes over the blocks.

    Example:

    >>> data_order(3, 5, seed=0).shape
    (5,)
    """
    rng = np.random.default_rng(seed)
    passes = math.ceil(total_samples / num_blocks)
    return np.concatenate([rng.permutation(num_blocks) for _ in range(passes)])[
        :total_samples
    ]


def build_run_model(config, tokenizer):
    """Step "model": the seeded model, compiled with the run's optimizer: a
    new one, or for a run with `config.initial_preset` the preset's, with
    LoRA of rank `config.lora_rank` (`keras_mhf.pretraining.presets`).

    Example:

    ```python
    lm = build_run_model(config, load_data(config).tokenizer)
    ```
    """
    keras.utils.set_random_seed(config.seed)
    if config.initial_preset is not None:  # fine-tuning (LoRA or full)
        lm = load_initial_model(config)
    else:
        lm = build_model(
            config.model,
            tokenizer,
            config.architecture,
            config.sequence_length,
            config.extra_layers,
            config.signature_rule,
            config.rematerialize,
        )
    optimizer = make_optimizer(
        config.learning_rate,
        config.steps,
        config.warmup_steps,
        config.weight_decay,
        config.optimizer,
        config.gradient_accumulation_steps,
    )
    lm.compile(optimizer=optimizer)
    return lm


class StepProgress(keras.callbacks.Callback):
    """Training progress for output that is not a terminal (a log file, a
    pipe, CI): `Progress`'s plain line every 10 s and one at the end, in
    place of Keras' per-step progress bar (`\\r` and colour codes).

    Args:
        progress: the `Progress` to update with the optimizer steps done.
        micro_batches: `fit` batches per optimizer step.

    Example:

    ```python
    lm.fit(dataset, verbose=0, callbacks=[
        StepProgress(Progress("steps 1-50 of 300", 50, "steps", True))
    ])
    ```
    """

    def __init__(self, progress, micro_batches=1):
        super().__init__()
        self.progress = progress
        self.micro_batches = micro_batches

    def on_train_batch_end(self, batch, logs=None):
        self.progress.update((batch + 1) // self.micro_batches)

    def on_train_end(self, logs=None):
        self.progress.close()


class StopOnNonFiniteLoss(keras.callbacks.Callback):
    """Stops `fit` after the first batch whose training loss is NaN or
    infinite and records its global step (like Keras' `TerminateOnNaN`).

    Args:
        first_step: the global step before the first batch of this `fit`.
        micro_batches: `fit` batches per optimizer step (gradient
            accumulation): the step of batch `b` (0-based) is
            `first_step + b // micro_batches + 1`, and `"train_step"` hook
            events come once per optimizer step.

    Example:

    ```python
    guard = StopOnNonFiniteLoss(first_step=100)
    lm.fit(dataset, callbacks=[guard])
    if guard.step is not None:
        print("diverged at step", guard.step)
    ```
    """

    def __init__(self, first_step, micro_batches=1):
        super().__init__()
        self.first_step = first_step
        self.micro_batches = micro_batches
        self.step = None
        self.loss = None

    def on_train_batch_end(self, batch, logs=None):
        step = self.first_step + batch // self.micro_batches + 1
        if (batch + 1) % self.micro_batches == 0:
            # `callback`, not `self.model`: reading `.model` syncs JAX's
            # state into the variables, which a hook does only when it
            # needs them.
            hooks.event("train_step", step=step, callback=self)
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        # `loss` is the running mean of this fit call: it turns non-finite
        # at the first non-finite batch loss.
        value = float(np.asarray(keras.ops.convert_to_numpy(loss)))
        if not math.isfinite(value) and self.step is None:
            self.step, self.loss = step, value
            self.model.stop_training = True


class StopOnSignal(keras.callbacks.Callback):
    """Ends a run at SIGINT (Ctrl-C) or SIGTERM, whatever the code running
    when the signal arrives does with the exception.

    While installed (`with guard.installed():`), both signals raise at once
    (`KeyboardInterrupt`; SIGTERM, what a cluster sends before it kills a
    job, `SystemExit(143)`), and the guard remembers them: where code below
    `fit` swallows the exception (a Ctrl-C raised inside `np.array(x)` while
    Keras converts a JAX loss for the callbacks was lost there, and
    training went on), `check`, at every batch and between the steps of a
    run, raises it again.

    Example:

    ```python
    guard = StopOnSignal()
    with guard.installed():
        lm.fit(dataset, callbacks=[guard])
    ```
    """

    def __init__(self):
        super().__init__()
        self.received = None

    def exception(self):
        """The exception of the signal received."""
        if self.received == signal.SIGINT:
            return KeyboardInterrupt()
        return SystemExit(128 + self.received)

    def check(self):
        """Raises the exception of a signal received, if any."""
        if self.received is not None:
            raise self.exception()

    def on_train_batch_begin(self, batch, logs=None):
        self.check()

    def on_train_batch_end(self, batch, logs=None):
        self.check()

    @contextlib.contextmanager
    def installed(self):
        """Handles SIGINT and SIGTERM within the block (in the main thread;
        elsewhere signals cannot be handled); the previous handlers are
        restored afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def stop(signum, frame):
            self.received = signum
            raise self.exception()

        previous = {
            number: signal.signal(number, stop)
            for number in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)


def loader_options():
    """The `grain.ReadOptions` of the training loader: two threads read
    batches ahead (at most 8), in order.

    Example:

    ```python
    dataset = window_dataset(corpus, "train", 128, 8, seed=0, num_steps=10)
    batches = dataset.to_iter_dataset(loader_options())
    ```
    """
    import grain

    return grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


def chunk_steps(config, chunk):
    """The optimizer steps `(first, last]` of a chunk.

    Example:

    ```python
    chunk_steps(RunConfig("d", "o", steps=120, checkpoint_every=50), 2)
    # (100, 120)
    ```
    """
    first = chunk * config.checkpoint_every
    return first, min(config.steps, first + config.checkpoint_every)


def train_chunk(config, lm, data, first, last, callbacks=(), curves=None):
    """Step "one chunk": one `fit` call over the windows of global steps
    `(first, last]` (`window_dataset` from `first`); returns the history.

    Each process of a multi-process job reads only its own rows of every
    global batch. With `config.gradient_accumulation_steps = N`, `fit` runs
    `N` micro-batches per optimizer step (`N * (last - first)` batches).

    Args:
        callbacks: more Keras callbacks for this `fit` call (`pretrain`'s
            `callbacks=`).
        curves: the run's TensorBoard writer (`training_curves.open_curves`)
            or `None`.

    Raises:
        NonFiniteLossError: the loss became NaN or infinite; training
            stopped at that step and nothing was written.
        NonFiniteWeightsError: a weight is NaN or infinite after the chunk.

    Example:

    ```python
    history = train_chunk(config, lm, data, first=100, last=150)
    ```
    """
    if config.verbose:
        print(f"Steps {first + 1}-{last} of {config.steps}")
    process_index, process_count = process_layout()
    parts = config.gradient_accumulation_steps
    dataset = window_dataset(
        data.corpus,
        "train",
        config.sequence_length,
        config.batch_size,
        config.seed,
        start_step=first,
        num_steps=last - first,
        process_index=process_index,
        process_count=process_count,
        micro_batches=parts,
    ).to_iter_dataset(loader_options())
    guard = StopOnNonFiniteLoss(first, parts)
    callbacks = [guard, *callbacks]
    if curves is not None:
        schedule = learning_rate_schedule(
            config.learning_rate, config.steps, config.warmup_steps
        )
        callbacks.append(
            TrainingCurves(
                curves,
                first,
                last,
                config.log_every,
                parts,
                config.batch_size * config.sequence_length,
                lambda step: float(
                    keras.ops.convert_to_numpy(schedule(step - 1))
                ),
            )
        )
    verbose = config.verbose if is_primary() else 0
    if verbose and not sys.stdout.isatty():
        # Keras' bar rewrites one line per step: lines, not the bar, in logs.
        label = f"steps {first + 1}-{last} of {config.steps}"
        progress = Progress(label, last - first, "steps", enabled=True)
        callbacks.append(StepProgress(progress, parts))
        verbose = 0
    preprocessor = lm.preprocessor
    lm.preprocessor = None  # the dataset yields token ids
    try:
        history = lm.fit(
            dataset,
            epochs=1,
            steps_per_epoch=(last - first) * parts,
            shuffle=False,
            verbose=verbose,
            callbacks=callbacks,
        )
    finally:
        lm.preprocessor = preprocessor
    checkpoints = RunCheckpoints.of(config)
    if guard.step is not None:
        raise checkpoints.non_finite_stop(
            NonFiniteLossError,
            f"the training loss became non-finite ({guard.loss}) at step "
            f"{guard.step}; training stopped there and no checkpoint, preset "
            "or summary was written from the diverged weights.",
            guard.step,
        )
    checkpoints.check_finite(lm, last, "checkpoint or log line")
    return history
