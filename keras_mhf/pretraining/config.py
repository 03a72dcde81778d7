"""The settings of a pre-training run and the process-wide state it needs.

- `RunConfig`: every setting, checked by `RunConfig.validate` before
  anything is written.
- `process_layout`, `is_primary`, `writing_alone`: where this process stands
  in a multi-process JAX job (only process 0 writes files).
- `run_scope`: the distribution, dtype policy and (JAX) persistent
  compilation cache of the run, restored afterwards.
"""

import contextlib
import dataclasses
import math
import os
import warnings

import keras
import numpy as np

from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    architecture_config,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    parse_architecture,
)
from keras_mhf.pretraining.errors import RunConfigError
from keras_mhf.utils.files import absolute_paths

MODELS = ("mhf", "standard")
SIGNATURE_RULES = ("unique", "reference", "repeated")
DISTRIBUTIONS = (None, "data", "model", "fsdp")
# `make_optimizer`'s names (see keras_mhf.pretraining.training).
OPTIMIZERS = ("adamw", "keras_adamw")
# Keras dtype policies a run trains in: float32; mixed_bfloat16 (float32
# weights and optimizer state, bf16 compute); bfloat16 (weights and AdamW
# state in bf16 too, as the authors trained). The loss and the cascade's
# softmax are float32 under every policy.
PRECISIONS = ("float32", "mixed_bfloat16", "bfloat16")


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass
class RunConfig:
    """The settings of one pre-training run (`keras_mhf.pretraining.pretrain`
    takes them as keyword arguments):

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
    (not on norms and biases), `optimizer` (`"adamw"`: epsilon after
    bias correction, as torch and the authors, `BiasCorrectedAdamW`;
    `"keras_adamw"`: Keras' `AdamW`), `validation_data` (raw text only:
    held-out text; if `None`, the documents whose
    `keras_mhf.data.validation_score` is below
    `validation_fraction`), `validation_blocks` (this many held-out
    windows are scored at every checkpoint), `calibrate` (MHF: fit
    the scoring temperature on the first half of those windows at
    the end and report the second half; default `True`; the Standard
    baseline is never calibrated), `checkpoint_every`
    (steps per chunk: validation, log line and checkpoint after each),
    `workers` (tokenizer processes when preparing raw text; default
    every core), `on_error` (raw text: a bad line stops the run naming
    its `file:line`, `"fail"`, or is skipped with a warning, `"skip"`),
    `precision` (the dtype policy of the run, one of `PRECISIONS`:
    `"float32"`, `"mixed_bfloat16"`, or `"bfloat16"`, the authors'
    bf16 weights and optimizer state; the loss and the cascade's
    softmax stay float32), `mixed_precision` (`True`: the same as
    `precision="mixed_bfloat16"`, kept from 0.1),
    `rematerialize` (a new model's blocks are recomputed in the backward
    pass, `MultiHashFormerBackbone(rematerialize=True)`: larger batches in
    the same memory, the same numbers; it is not part of what a resumed
    run must match),
    `seed` (seeds the weights and the training windows), `distribution`
    (`None`, `"data"`, `"model"` or `"fsdp"`: all devices with
    `keras.distribution`, JAX only, see `distribution`; other backends are
    refused),
    `mesh` (`(batch, model)` sizes or `"2x4"`),
    `compilation_cache` (JAX: where compiled programs are kept so
    that a resumed run starts training within seconds; `"auto"`:
    `output_dir/compilation_cache`; `None` or `"none"`: off),
    `verify_data` (re-hash every shard of the prepared corpus
    against its `index.json` and check its token ids when the run
    starts or resumes; default `True`), `discard_unusable_checkpoints`
    (when `output_dir` holds checkpoints and none can be loaded, set them
    aside as `step_NNNNNN.unusable` and train from step 0; by default such
    a run is refused, on every rerun) and `verbose`.

    Example:

    ```python
    config = RunConfig(data="prepared/openstax", output_dir="runs/mhf")
    config.validate()
    ```
    """

    data: object
    output_dir: str
    tokenizer: str = None
    vocabulary_size: int = 4000
    model: str = "mhf"
    architecture: str = "mini_h4b1024"
    extra_layers: int = 0
    signature_rule: str = "unique"
    sequence_length: int = 128
    batch_size: int = 8
    steps: int = 300
    learning_rate: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    optimizer: str = "adamw"
    validation_data: object = None
    validation_fraction: float = 0.05
    validation_blocks: int = 64
    calibrate: bool = True
    checkpoint_every: int = 50
    workers: int = None
    on_error: str = "fail"
    precision: str = "float32"
    mixed_precision: bool = False
    rematerialize: bool = False
    seed: int = 0
    distribution: str = None
    mesh: object = None
    compilation_cache: str = "auto"
    verify_data: bool = True
    discard_unusable_checkpoints: bool = False
    verbose: int = 1
    initial_preset: str = None
    lora_rank: int = None
    train_tables: bool = False

    # Paths a user gives, made absolute once here (the API's entry, which
    # the command line goes through too): a run's files, Orbax's
    # checkpoints and a resume from another directory then all mean the
    # same place.
    def __post_init__(self):
        for name in (
            "data",
            "output_dir",
            "tokenizer",
            "validation_data",
            "initial_preset",
        ):
            setattr(self, name, absolute_paths(getattr(self, name)))
        if self.compilation_cache not in (None, "", "auto", "none"):
            self.compilation_cache = absolute_paths(self.compilation_cache)

    @property
    def chunks(self):
        return math.ceil(self.steps / self.checkpoint_every)

    def path(self, name):
        return os.path.join(self.output_dir, name)

    def dtype_policy(self):
        """The run's Keras dtype policy name (`precision`, or
        `"mixed_bfloat16"` for the older `mixed_precision=True`)."""
        if self.mixed_precision and self.precision == "float32":
            return "mixed_bfloat16"
        return self.precision

    def validate(self):
        """Raises `RunConfigError` naming every invalid setting (the rules of
        `_RULES`, in order).

        Checks what can be checked without data or devices; `run_scope`
        checks the batch size against the device mesh and `load_data` the
        corpus length.
        """
        problems = []
        for name, check in _RULES:
            found = check(self, name, getattr(self, name))
            problems += [found] if isinstance(found, str) else found or []
        if (
            self.dtype_policy() == "bfloat16"
            and self.optimizer == "keras_adamw"
        ):
            # Keras' AdamW computes 1 - beta_2**t in the weights' dtype: in
            # bf16, 0.999 is 1.0 and no weight would ever change.
            problems.append(
                "optimizer 'keras_adamw' cannot train bfloat16 weights (it "
                "computes its bias correction in bf16, where beta_2 = 0.999 "
                "rounds to 1.0, so no weight changes); use --optimizer adamw "
                "or --precision mixed_bfloat16"
            )
        if problems:
            raise RunConfigError("; ".join(problems) + ".")
        if self.warmup_steps >= self.steps and self.steps > 1:
            warnings.warn(
                f"warmup_steps={self.warmup_steps} >= steps={self.steps}: the "
                f"warmup is shortened to {self.steps - 1} steps.",
                stacklevel=2,
            )

    def _check_initial_preset(self):
        """A run from a preset: the preset decides the model, its
        architecture and its tokenizer (`keras_mhf.pretraining.presets`);
        returns the problems found."""
        from keras_mhf.pretraining.presets import preset_kind
        from keras_mhf.pretraining.presets import preset_tokenizer

        problems = []
        rank = self.lora_rank
        if rank is not None and (not _is_int(rank) or rank < 1):
            problems.append(
                f"--lora-rank must be an integer >= 1, got {rank!r}"
            )
        if self.train_tables is True and rank is None:
            problems.append("--train-tables applies to LoRA (--lora-rank)")
        if self.extra_layers:
            problems.append("--extra-layers does not apply to a preset")
        try:
            self.model = preset_kind(self.initial_preset)
            tokenizer = preset_tokenizer(self.initial_preset)
        except RunConfigError as error:
            return problems + [str(error).rstrip(".")]
        self.architecture = "preset"
        if self.tokenizer is None:
            self.tokenizer = tokenizer
        elif os.path.abspath(self.tokenizer) != os.path.abspath(tokenizer):
            from keras_mhf.utils.files import file_sha256

            if not os.path.isfile(self.tokenizer) or file_sha256(
                self.tokenizer
            ) != file_sha256(tokenizer):
                problems.append(
                    f"--tokenizer {self.tokenizer} is not the preset's "
                    f"tokenizer ({tokenizer}); leave it out to use the "
                    "preset's"
                )
        return problems


def _flag(name):
    return "--" + name.replace("_", "-")


def _is_finite_number(value):
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _rule(ok, message):
    """The check of one setting: `message`, formatted with the setting's
    `flag`, `name` and `value`, unless `ok(value)`."""

    def check(config, name, value):
        if not ok(value):
            return message.format(flag=_flag(name), name=name, value=value)
        return None

    return check


def _check_preset(config, name, preset):
    """A run from a preset (`RunConfig._check_initial_preset`), or none of
    the settings that need one."""
    if preset is not None:
        return config._check_initial_preset()
    if config.lora_rank is not None or config.train_tables is True:
        return (
            "--lora-rank and --train-tables need a preset to fine-tune "
            "(initial_preset)"
        )
    return None


def _check_architecture(config, name, architecture):
    """An architecture name that parses, with a hash part for an MHF model
    (a preset decides its own)."""
    if config.initial_preset is not None:
        return None
    try:
        _, hashes = parse_architecture(architecture)
    except ValueError as error:
        return str(error).rstrip(".")
    if config.model == "mhf" and hashes is None:
        return (
            f"--architecture {architecture} has no hash part; an MHF model "
            "needs '<trunk>_h<H>b<B>' (e.g. tiny_h3b512)"
        )
    return None


def _check_extra_layers(config, name, extra_layers):
    if config.model == "mhf" and _is_int(extra_layers) and extra_layers:
        return "--extra-layers applies to --model standard (Standard+kL)"
    return None


def _check_mesh(config, name, mesh):
    if mesh is None:
        return None
    from keras_mhf.pretraining.distribution import parse_mesh

    try:
        parse_mesh(mesh)
    except ValueError as error:
        return str(error).rstrip(".")
    return None


_AT_LEAST_1 = _rule(
    lambda v: _is_int(v) and v >= 1,
    "{flag} must be an integer >= 1, got {value!r}",
)
_AT_LEAST_0 = _rule(
    lambda v: _is_int(v) and v >= 0,
    "{flag} must be an integer >= 0, got {value!r}",
)
_TRUE_OR_FALSE = _rule(
    lambda v: isinstance(v, (bool, np.bool_)),
    "{name} must be True or False, got {value!r}",
)

# `RunConfig.validate`'s rules, in the order their problems are reported:
# (setting, check), a check returning a problem, a list of them or `None`.
# The preset's rule sets `model` and `architecture` from the preset, so it
# comes before the rules that read them.
_RULES = (
    *(
        (name, _AT_LEAST_1)
        for name in (
            "sequence_length",
            "steps",
            "batch_size",
            "checkpoint_every",
            "validation_blocks",
            "vocabulary_size",
        )
    ),
    *((name, _AT_LEAST_0) for name in ("warmup_steps", "extra_layers", "seed")),
    (
        "workers",
        _rule(
            lambda v: v is None or (_is_int(v) and v >= 1),
            "{flag} must be an integer >= 1, got {value!r}",
        ),
    ),
    (
        "learning_rate",
        _rule(
            lambda v: _is_finite_number(v) and v > 0,
            "{flag} must be a finite number > 0, got {value!r}",
        ),
    ),
    (
        "weight_decay",
        _rule(
            lambda v: _is_finite_number(v) and v >= 0,
            "{flag} must be a finite number >= 0, got {value!r}",
        ),
    ),
    (
        "validation_fraction",
        _rule(
            lambda v: _is_finite_number(v) and 0 < v < 1,
            "{flag} must be between 0 and 1 (exclusive), got {value!r}",
        ),
    ),
    *(
        (name, _TRUE_OR_FALSE)
        for name in ("calibrate", "verify_data", "train_tables")
    ),
    (
        "model",
        _rule(
            lambda v: v in MODELS,
            "{flag} must be 'mhf' or 'standard', got {value!r}",
        ),
    ),
    (
        "on_error",
        _rule(
            lambda v: v in ("fail", "skip"),
            "{flag} must be 'fail' or 'skip', got {value!r}",
        ),
    ),
    (
        "precision",
        _rule(
            lambda v: v in PRECISIONS,
            f"{{flag}} must be one of {list(PRECISIONS)}, got {{value!r}}",
        ),
    ),
    (
        "optimizer",
        _rule(
            lambda v: v in OPTIMIZERS,
            f"{{flag}} must be one of {sorted(OPTIMIZERS)}, got {{value!r}}",
        ),
    ),
    (
        "signature_rule",
        _rule(
            lambda v: v in SIGNATURE_RULES,
            f"signature_rule must be one of {SIGNATURE_RULES}, got {{value!r}}",
        ),
    ),
    (
        "distribution",
        _rule(
            lambda v: v in DISTRIBUTIONS,
            "{flag} must be 'data', 'model' or 'fsdp' (or left out), got "
            "{value!r}",
        ),
    ),
    (
        "data",
        _rule(
            lambda v: (
                not (v is None or (isinstance(v, (str, list, tuple)) and not v))
            ),
            "--data is required: a prepared directory or text",
        ),
    ),
    ("output_dir", _rule(bool, "--output is required")),
    ("initial_preset", _check_preset),
    ("architecture", _check_architecture),
    ("extra_layers", _check_extra_layers),
    (
        "compilation_cache",
        _rule(
            lambda v: v is None or isinstance(v, (str, os.PathLike)),
            "{flag} must be a directory, 'auto' or 'none', got {value!r}",
        ),
    ),
    ("mesh", _check_mesh),
)


def process_layout():
    """`(process_index, process_count)` of this process in a multi-process
    JAX job (`keras_mhf.pretraining.distribution.initialize`); `(0, 1)` otherwise.

    Example:

    >>> process_layout()
    (0, 1)
    """
    if keras.config.backend() != "jax":
        return 0, 1
    import jax

    return jax.process_index(), jax.process_count()


def _local_device_count():
    import jax

    return jax.local_device_count()


def is_primary():
    """Whether this process writes the run's files: only process 0 does
    (log, preset, summary, checkpoints' `state.json`; every process writes
    its own shards of a checkpoint)."""
    return process_layout()[0] == 0


@contextlib.contextmanager
def writing_alone():
    """Lets process 0 save a preset while the other processes go on: in a
    multi-process job, creating a variable under a distribution is a
    collective operation (and Keras' saving creates one), so the save runs
    without the distribution. Weights split across processes are gathered
    first (`distribution.whole_weights`)."""
    if process_layout()[1] == 1:
        yield
        return
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(previous)


@contextlib.contextmanager
def run_scope(config):
    """Sets the process-wide state the run needs (a distribution for
    `config.distribution`, the dtype policy of `config.precision`, on JAX
    a persistent compilation cache, see `compilation_cache_directory`) and
    restores the previous state afterwards.

    In a multi-process JAX job each process feeds only its own rows of every
    global batch, so the distribution's `auto_shard_dataset` is turned off.
    A model-parallel layout is fitted to the run's model (`backbone_config`):
    a dimension that its mesh axis does not divide is replicated.

    Raises:
        RunConfigError: a batch size the batch axis of the device mesh (or
            the number of processes) does not divide, model parallelism over
            several processes, several processes without a distribution, or
            a mesh that does not match the devices.

    Example:

    ```python
    with run_scope(RunConfig("d", "o", distribution="data")):
        lm = build_run_model(config, tokenizer)  # built under DataParallel
    ```
    """
    previous_policy = keras.config.dtype_policy()
    previous_distribution = keras.distribution.distribution()
    process_index, process_count = process_layout()
    if process_count > 1:
        if config.distribution is None:
            raise RunConfigError(
                f"This is process {process_index} of {process_count} of a "
                "multi-process job, but no distribution was given; pass "
                "--distribution data (or fsdp, or model) so that the "
                "processes train one model."
            )
        if config.batch_size % process_count:
            raise RunConfigError(
                f"--batch-size {config.batch_size} does not divide by the "
                f"{process_count} processes; use a multiple of {process_count}."
            )
    cache = contextlib.ExitStack()
    try:
        cache.enter_context(_compilation_cache(config))
        if config.distribution is not None:
            from keras_mhf.pretraining.distribution import check_batch_size
            from keras_mhf.pretraining.distribution import check_model_axis
            from keras_mhf.pretraining.distribution import make_distribution

            try:
                strategy = make_distribution(
                    config.distribution,
                    config.mesh,
                    config=backbone_config(config),
                )
                check_batch_size(config.batch_size, strategy)
                if process_count > 1:
                    check_model_axis(strategy, _local_device_count())
            except ValueError as error:
                raise RunConfigError(str(error)) from error
            if process_count > 1:
                strategy.auto_shard_dataset = False
            keras.distribution.set_distribution(strategy)
        keras.config.set_dtype_policy(config.dtype_policy())
        yield
    finally:
        keras.config.set_dtype_policy(previous_policy)
        if config.distribution is not None:
            keras.distribution.set_distribution(previous_distribution)
        cache.close()


def backbone_config(config):
    """The backbone arguments of the run's model, from its architecture name
    (before the model exists), so that a model-parallel layout can be fitted
    to it: dimensions the mesh does not divide are replicated.

    Example:

    ```python
    backbone_config(RunConfig("d", "o", architecture="tiny_h3b64"))
    # {"num_layers": 2, "hidden_dim": 32, ..., "num_buckets": 64, ...}
    ```
    """
    if config.initial_preset is not None:
        from keras_mhf.pretraining.presets import preset_backbone_config

        return preset_backbone_config(config.initial_preset)
    settings = architecture_config(config.architecture, config.extra_layers)
    if config.model == "standard":  # the hash part of the name is ignored
        _, hashes = parse_architecture(config.architecture)
        for name in hashes or {}:
            settings.pop(name, None)
    return settings


def compilation_cache_directory(config):
    """The persistent compilation cache of a run: `OUTPUT/compilation_cache`
    for `compilation_cache="auto"`, the given directory, or `None` (disabled
    with `None`/`"none"`, and on backends other than JAX).

    Example:

    ```python
    compilation_cache_directory(RunConfig("d", "runs/mhf"))
    # "runs/mhf/compilation_cache" on JAX, None elsewhere
    ```
    """
    setting = config.compilation_cache
    if keras.config.backend() != "jax" or setting in (None, "", "none"):
        return None
    if setting == "auto":
        return config.path("compilation_cache")
    return os.fspath(setting)


@contextlib.contextmanager
def _compilation_cache(config):
    """On JAX, keeps compiled programs (the weight initialisers, the train
    and scoring steps) in a persistent cache for the run, so that a resumed
    run does not compile them again; a cache configured outside the run
    (e.g. `JAX_COMPILATION_CACHE_DIR`) is left as it is. The previous
    settings are restored afterwards. Compiled programs are the same either
    way, so results do not change."""
    directory = compilation_cache_directory(config)
    if directory is None:
        yield
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    if jax.config.jax_compilation_cache_dir:
        yield
        return
    options = {
        "jax_compilation_cache_dir": os.path.abspath(directory),
        # Cache every program: the many small ones add up to seconds.
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    previous = {name: getattr(jax.config, name) for name in options}
    for name, value in options.items():
        jax.config.update(name, value)
    cc.reset_cache()
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        cc.reset_cache()
