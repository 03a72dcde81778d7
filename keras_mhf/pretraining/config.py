"""The settings of a pre-training run and the process-wide state it needs.

- `RunConfig`: every setting (the fields are the table
  `keras_mhf.settings.RUN_SETTINGS`), checked by `RunConfig.validate`
  before anything is written.
- `process_layout`, `is_primary`, `writing_alone`: where this process stands
  in a multi-process JAX job (only process 0 writes files).
- `check_devices`: the run's settings against the devices and processes
  (the distribution it needs), before anything is written.
- `run_scope`: installs the distribution, dtype policy and (JAX) persistent
  compilation cache of the run, and restores them afterwards.
"""

import contextlib
import dataclasses
import math
import os
import warnings

import keras

from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    architecture_config,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    parse_architecture,
)
from keras_mhf.pretraining.errors import RunConfigError
from keras_mhf.settings import run_settings
from keras_mhf.settings.setting import COMMANDS
from keras_mhf.settings.setting import PATH
from keras_mhf.settings.setting import PATHS
from keras_mhf.utils.files import absolute_paths

# The settings that are paths: made absolute once, at the API's entry.
_PATHS = tuple(
    s.name for s in run_settings.RUN_SETTINGS if s.type in (PATH, PATHS)
)


def _fields_from_table(cls):
    """Makes `cls` a dataclass whose fields are the `RunConfig` settings of
    `RUN_SETTINGS`, in the table's order (the two every run needs, `data`
    and `output_dir`, first and without a default), and appends each
    setting's help to its docstring."""
    settings = [s for s in run_settings.RUN_SETTINGS if s.run_config]
    own = dict(cls.__dict__.get("__annotations__", {}))
    cls.__annotations__ = {}
    lines = []
    for setting in settings:
        cls.__annotations__[setting.name] = object
        # Required by every command: a positional field.
        if not (setting.required and setting.commands == COMMANDS):
            setattr(cls, setting.name, setting.default)
        lines.append(
            f"        {setting.name}: {setting.help} (default: "
            f"{setting.default!r}; flag: {setting.flag or '-'})."
        )
    cls.__annotations__.update(own)
    cls.__doc__ = cls.__doc__.replace(
        "    Settings:\n", "    Settings:\n" + "\n".join(lines) + "\n", 1
    )
    return dataclasses.dataclass(cls)


@_fields_from_table
class RunConfig:
    """The settings of one pre-training or fine-tuning run
    (`keras_mhf.pretraining.pretrain` takes them as keyword arguments; a
    settings file names them the same way). Each field is a setting of
    `keras_mhf.settings.RUN_SETTINGS`, listed below with its help.

    Settings:

    Attributes:
        run_checkpoints: the run's `RunCheckpoints`, made on first use by
            `RunCheckpoints.of(config)` (not a setting).

    Example:

    ```python
    config = RunConfig(data="prepared/openstax", output_dir="runs/mhf")
    config.validate()
    ```
    """

    run_checkpoints: object = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    # Paths a user gives, made absolute once here (the API's entry, which
    # the command line goes through too): a run's files, Orbax's
    # checkpoints and a resume from another directory then all mean the
    # same place. `mixed_precision=True` (0.1) is `precision`
    # "mixed_bfloat16"; a LoRA rank of 0 is full fine-tuning (`None`).
    def __post_init__(self):
        for name in _PATHS:
            setattr(self, name, absolute_paths(getattr(self, name)))
        for name in ("compilation_cache", "tensorboard"):  # or a keyword
            if getattr(self, name) not in (None, "", "auto", "none"):
                setattr(self, name, absolute_paths(getattr(self, name)))
        if self.mixed_precision is True and self.precision == "float32":
            self.precision = "mixed_bfloat16"
        if self.lora_rank == 0 and not isinstance(self.lora_rank, bool):
            self.lora_rank = None

    @property
    def command(self):
        """`"finetune"` for a run from a preset, else `"pretrain"`."""
        return "pretrain" if self.initial_preset is None else "finetune"

    @property
    def chunks(self):
        return math.ceil(self.steps / self.checkpoint_every)

    def path(self, name):
        return os.path.join(self.output_dir, name)

    def dtype_policy(self):
        """The run's Keras dtype policy name (`precision`)."""
        return self.precision

    def validate(self):
        """Raises `RunConfigError` naming every invalid setting (each
        setting's rule, in the table's order, then what the preset of a
        fine-tuning run decides).

        Checks what can be checked without data or devices; `check_devices`
        checks the batch size against the device mesh and `load_data` the
        corpus length.
        """
        problems = run_settings.setting_problems(self)
        if self.initial_preset is not None and not problems:
            problems += self._take_from_preset()
        if problems:
            raise RunConfigError("; ".join(problems) + ".")
        if self.warmup_steps >= self.steps and self.steps > 1:
            warnings.warn(
                f"warmup_steps={self.warmup_steps} >= steps={self.steps}: the "
                f"warmup is shortened to {self.steps - 1} steps.",
                stacklevel=2,
            )

    def _take_from_preset(self):
        """A run from a preset: the preset decides the model, its
        architecture and its tokenizer (`keras_mhf.pretraining.presets`);
        returns the problems found."""
        from keras_mhf.pretraining.presets import preset_kind
        from keras_mhf.pretraining.presets import preset_tokenizer

        problems = []
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


def micro_batch_size(config):
    """Windows per micro-batch (all processes together): the global batch
    over `gradient_accumulation_steps`.

    Example:

    >>> micro_batch_size(RunConfig("d", "o", batch_size=256,
    ...                            gradient_accumulation_steps=8))
    32
    """
    return config.batch_size // config.gradient_accumulation_steps


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


def check_devices(config):
    """Checks the run's settings against this process's place in the job
    and the devices, and returns the distribution the run needs (`None`
    without `config.distribution`); changes no process state.

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
    distribution = check_devices(RunConfig("d", "o", distribution="data"))
    ```
    """
    process_index, process_count = process_layout()
    if process_count > 1:
        if config.distribution is None:
            raise RunConfigError(
                f"This is process {process_index} of {process_count} of a "
                "multi-process job, but no distribution was given; pass "
                "--distribution data (or fsdp, or model) so that the "
                "processes train one model."
            )
        parts = process_count * config.gradient_accumulation_steps
        if config.batch_size % parts:
            raise RunConfigError(
                f"--batch-size {config.batch_size} does not divide by the "
                f"{process_count} processes x "
                f"{config.gradient_accumulation_steps} micro-batches; use a "
                f"multiple of {parts}."
            )
    if config.distribution is None:
        return None
    from keras_mhf.pretraining.distribution import check_batch_size
    from keras_mhf.pretraining.distribution import check_model_axis
    from keras_mhf.pretraining.distribution import make_distribution

    try:
        strategy = make_distribution(
            config.distribution, config.mesh, config=backbone_config(config)
        )
        # Each fit step is one micro-batch, split over the devices.
        micro = micro_batch_size(config)
        check_batch_size(
            micro,
            strategy,
            f"the micro-batch of {micro} windows (--batch-size "
            f"{config.batch_size} / --gradient-accumulation-steps "
            f"{config.gradient_accumulation_steps})"
            if config.gradient_accumulation_steps > 1
            else None,
        )
        if process_count > 1:
            check_model_axis(strategy, _local_device_count())
    except ValueError as error:
        raise RunConfigError(str(error)) from error
    if process_count > 1:
        strategy.auto_shard_dataset = False
    return strategy


@contextlib.contextmanager
def run_scope(config, distribution=None):
    """Installs the process-wide state of the run: `distribution` (from
    `check_devices`), the dtype policy of `config.precision` and, on JAX, a
    persistent compilation cache (see `compilation_cache_directory`); the
    previous state is restored afterwards.

    Example:

    ```python
    distribution = check_devices(config)
    with run_scope(config, distribution):
        lm = build_run_model(config, tokenizer)  # built under DataParallel
    ```
    """
    previous_policy = keras.config.dtype_policy()
    previous_distribution = keras.distribution.distribution()
    with _compilation_cache(config):
        try:
            if distribution is not None:
                keras.distribution.set_distribution(distribution)
            keras.config.set_dtype_policy(config.dtype_policy())
            yield
        finally:
            keras.config.set_dtype_policy(previous_policy)
            if distribution is not None:
                keras.distribution.set_distribution(previous_distribution)


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


def tensorboard_directory(config):
    """Where a run writes its TensorBoard event files:
    `OUTPUT/tensorboard` for `tensorboard="auto"`, the given directory, or
    `None` (`"none"`: no event files).

    Example:

    ```python
    tensorboard_directory(RunConfig("d", "runs/mhf"))  # ".../runs/mhf/tensorboard"
    ```
    """
    if config.tensorboard in (None, "", "none"):
        return None
    if config.tensorboard == "auto":
        return config.path("tensorboard")
    return os.fspath(config.tensorboard)


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
