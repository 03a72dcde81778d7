"""Pre-training with `model.fit`: the engine behind `recipes/pretrain.py`.

`pretrain` runs named steps:

1. `RunConfig.validate` checks every setting before anything is written.
2. `run_scope` sets the process-wide state of the run (a distribution, a
   dtype policy, on JAX a persistent compilation cache) and restores it
   afterwards.
3. `load_data` opens a prepared corpus (a directory with `index.json`, see
   `keras_mhf.data.prepare_data`), or first prepares raw text into
   `OUTPUT/data/` (training a SentencePiece tokenizer on a bounded sample of
   it when none is given), checks the tokenizer against the corpus and reads
   the fixed validation windows.
4. `build_run_model` builds the seeded model and its optimizer.
5. `resume` loads the newest complete checkpoint, if any, and returns the
   global step to continue from.
6. For each chunk of `checkpoint_every` optimizer steps: `train_chunk` (one
   `fit` call on the windows of those steps, drawn from `(seed, step)`, see
   `keras_mhf.data.window_dataset`), `write_log_row` (validation perplexity,
   a line of `log.csv`) and `save_checkpoint`.
7. `finish` writes the preset, `summary.json` and `loss.png` of a finished
   run.

Checkpoints are directories `OUTPUT/checkpoints/step_NNNNNN/` holding the
weights (model and optimizer state, `model.weights.h5`) and the run state
(`state.json`: step, chunk, the settings that must not change, the weights'
size and sha256). Each is written under a temporary name, flushed to disk and
renamed in one atomic step; older ones are pruned only after that (the last
`KEEP_CHECKPOINTS` are kept). Training data is a pure function of the seed and
the global step, so a run killed at any point and rerun with the same
settings resumes from the newest complete checkpoint, reads nothing it already
read, and ends with the same weights, to the bit, as an uninterrupted run.

A run stops at the first non-finite training loss (`NonFiniteLossError`) and
never writes a checkpoint, preset or summary from non-finite weights.

Example:

```python
from keras_mhf.pretraining import pretrain

lm, summary = pretrain(
    "prepared/openstax", "runs/mhf", architecture="tiny_h3b512", steps=100
)
```
"""

import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import shutil
import time
import warnings

import keras
import numpy as np

from keras_mhf.data import PreparedCorpus
from keras_mhf.data import blocks_to_features
from keras_mhf.data import list_corpus_files
from keras_mhf.data import prepare_data
from keras_mhf.data import read_documents
from keras_mhf.data import tokenizer_fingerprint
from keras_mhf.data import validation_score
from keras_mhf.data import validation_windows
from keras_mhf.data import window_dataset
from keras_mhf.data.prepared_corpus import INDEX_FILE
from keras_mhf.evaluation import perplexity
from keras_mhf.models.multi_hash_former_architectures import parse_architecture
from keras_mhf.models.multi_hash_former_causal_lm import MultiHashFormerCausalLM
from keras_mhf.models.multi_hash_former_tokenizer import (
    MultiHashFormerTokenizer,
)
from keras_mhf.models.standard_causal_lm import standard_causal_lm
from keras_mhf.utils.keras_utils import count_trainable_parameters

LOG_FIELDS = [
    "step",
    "tokens",
    "train_loss",
    "val_loss",
    "val_perplexity",
    "val_accuracy",
    "learning_rate",
    "seconds",
]
MODELS = ("mhf", "standard")
SIGNATURE_RULES = ("unique", "reference", "repeated")
DISTRIBUTIONS = (None, "data", "model")

CHECKPOINTS = "checkpoints"
CHECKPOINT_FORMAT = "keras_mhf.pretraining_checkpoint"
CHECKPOINT_VERSION = 1
WEIGHTS_FILE = "model.weights.h5"
STATE_FILE = "state.json"
KEEP_CHECKPOINTS = 2
_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")
_TEMPORARY_PREFIX = ".tmp-"
_UNUSABLE_SUFFIX = ".unusable"


# The tokenizer trained when none is given sees at most this much of the
# training text (its first documents), so memory does not grow with the corpus.
TOKENIZER_SAMPLE_DOCUMENTS = 100_000
TOKENIZER_SAMPLE_CHARACTERS = 20_000_000


class RunConfigError(ValueError):
    """A setting of the run is invalid, or the data, tokenizer or output
    directory do not fit it. Raised before training; the recipe reports it as
    `error: ...` and exits 2.

    Example:

    ```python
    RunConfig("d", "o", steps=0).validate()  # RunConfigError: --steps ...
    ```
    """


class CheckpointError(RuntimeError):
    """The output directory holds checkpoints, none of which can be loaded.

    Example:

    ```python
    try:
        pretrain("prepared/openstax", "runs/mhf")
    except CheckpointError as error:
        print(error)  # names each checkpoint and what is wrong with it
    ```
    """


class NonFiniteTrainingError(RuntimeError):
    """Training produced a non-finite loss or non-finite weights.

    Attributes:
        step: the global optimizer step at which it was detected.
        checkpoint: the newest (finite) checkpoint kept, or `None`.

    Example:

    ```python
    try:
        pretrain("prepared/openstax", "runs/mhf", learning_rate=1e6)
    except NonFiniteTrainingError as error:
        print(error.step, error.checkpoint)
    ```
    """

    def __init__(self, message, step, checkpoint):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class NonFiniteLossError(NonFiniteTrainingError):
    """The training loss became NaN or infinite (e.g. a learning rate that
    is too high); nothing was written from the diverged weights."""


class NonFiniteWeightsError(NonFiniteTrainingError):
    """A weight became NaN or infinite although the loss stayed finite; the
    checkpoint, preset or summary that was about to be written was not."""


def _event(name, **info):
    """Instrumentation point: does nothing. Tests replace it to inject
    faults at the named points of a checkpoint write (raise, or SIGKILL the
    process) and tools replace it to time a run (`"train_step"` fires after
    every optimizer step). Events: `"weights_written"` (`path`: the weights
    file in the temporary checkpoint directory), `"checkpoint_complete"`
    (`path`: the complete temporary directory, before its rename),
    `"checkpoint_renamed"` (`path`: the final directory, before pruning),
    `"train_step"` (`step`: the global step just run)."""


# --- Public helpers (also used by recipes/expand_vocabulary.py) ------------


def tokenizer_training_sample(
    documents,
    max_documents=TOKENIZER_SAMPLE_DOCUMENTS,
    max_characters=TOKENIZER_SAMPLE_CHARACTERS,
    exclude=None,
):
    """Streams the first documents of `documents` up to a size cap.

    Args:
        documents: iterable of document strings (read lazily).
        max_documents: stop after this many documents.
        max_characters: stop once this many characters were yielded (the
            document that crosses the cap is the last one).
        exclude: optional predicate; documents for which it is true are
            skipped (e.g. the held-out ones).

    Example:

    >>> list(tokenizer_training_sample(["ab", "cd", "ef"], max_characters=3))
    ['ab', 'cd']
    """
    count = characters = 0
    for text in documents:
        if count >= max_documents or characters >= max_characters:
            return
        if exclude is not None and exclude(text):
            continue
        count += 1
        characters += len(text)
        yield text


def train_sentencepiece(documents, vocabulary_size, path):
    """Trains a byte-fallback BPE SentencePiece model (`<unk>`, `<s>`,
    `</s>` at ids 0-2, like Mistral's) and writes it to `path` atomically.

    SentencePiece holds every document it is given in memory: pass a bounded
    sample (`tokenizer_training_sample`) for a large corpus.

    Args:
        documents: iterable of document strings.
        vocabulary_size: number of pieces.
        path: the `.model` file to write.

    Example:

    ```python
    train_sentencepiece(read_documents("corpus.txt"), 4000, "tok.model")
    ```
    """
    import sentencepiece as spm

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(documents),
            model_writer=model,
            vocab_size=vocabulary_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=0.9995,
            max_sentence_length=1 << 16,
            hard_vocab_limit=False,
            minloglevel=2,
        )
    except RuntimeError as error:
        if "required_chars" in str(error):
            raise ValueError(
                f"vocabulary_size={vocabulary_size} is too small for this "
                "text: byte fallback needs 256 byte pieces plus one piece per "
                f"frequent character ({error}). Use a larger vocabulary_size."
            ) from error
        raise
    _write_atomically(path, model.getvalue())
    return path


def make_optimizer(learning_rate, total_steps, warmup_steps, weight_decay=0.1):
    """AdamW, linear warmup then cosine decay to 0, global-norm clipping 1.0,
    weight decay on kernels and tables only (not on norms or biases).

    Example:

    ```python
    optimizer = make_optimizer(2e-3, total_steps=300, warmup_steps=30)
    ```
    """
    warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        decay_steps=max(total_steps - warmup_steps, 1),
        warmup_target=learning_rate,
        warmup_steps=warmup_steps,
        alpha=0.0,
    )
    optimizer = keras.optimizers.AdamW(
        learning_rate=schedule,
        weight_decay=weight_decay,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-8,
        global_clipnorm=1.0,
    )
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
    return optimizer


def build_model(
    kind,
    tokenizer,
    architecture,
    sequence_length,
    extra_layers=0,
    signature_rule="unique",
):
    """A new MHF (`kind="mhf"`) or Standard (`"standard"`) causal LM.

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
        )
    if kind == "standard":
        return standard_causal_lm(
            tokenizer,
            architecture,
            extra_layers=extra_layers,
            sequence_length=sequence_length,
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


# --- Settings ---------------------------------------------------------------


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass
class RunConfig:
    """The settings of one pre-training run (see `pretrain` for each).

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
    validation_data: object = None
    validation_fraction: float = 0.05
    validation_blocks: int = 64
    checkpoint_every: int = 50
    workers: int = None
    mixed_precision: bool = False
    seed: int = 0
    distribution: str = None
    mesh: object = None
    compilation_cache: str = "auto"
    verbose: int = 1

    @property
    def chunks(self):
        return math.ceil(self.steps / self.checkpoint_every)

    def path(self, name):
        return os.path.join(self.output_dir, name)

    def validate(self):
        """Raises `RunConfigError` naming every invalid setting.

        Checks what can be checked without data or devices; `run_scope`
        checks the batch size against the device mesh and `load_data` the
        corpus length.
        """
        problems = []
        for name in (
            "sequence_length",
            "steps",
            "batch_size",
            "checkpoint_every",
            "validation_blocks",
            "vocabulary_size",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                problems.append(
                    f"{_flag(name)} must be an integer >= 1, got {value!r}"
                )
        for name in ("warmup_steps", "extra_layers", "seed"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                problems.append(
                    f"{_flag(name)} must be an integer >= 0, got {value!r}"
                )
        if self.workers is not None and (
            not _is_int(self.workers) or self.workers < 1
        ):
            problems.append(
                f"--workers must be an integer >= 1, got {self.workers!r}"
            )
        if not _is_finite_number(self.learning_rate) or self.learning_rate <= 0:
            problems.append(
                "--learning-rate must be a finite number > 0, got "
                f"{self.learning_rate!r}"
            )
        if not _is_finite_number(self.weight_decay) or self.weight_decay < 0:
            problems.append(
                "--weight-decay must be a finite number >= 0, got "
                f"{self.weight_decay!r}"
            )
        if not (
            _is_finite_number(self.validation_fraction)
            and 0 < self.validation_fraction < 1
        ):
            problems.append(
                "--validation-fraction must be between 0 and 1 (exclusive), "
                f"got {self.validation_fraction!r}"
            )
        if self.model not in MODELS:
            problems.append(
                f"--model must be 'mhf' or 'standard', got {self.model!r}"
            )
        if self.signature_rule not in SIGNATURE_RULES:
            problems.append(
                f"signature_rule must be one of {SIGNATURE_RULES}, got "
                f"{self.signature_rule!r}"
            )
        if self.distribution not in DISTRIBUTIONS:
            problems.append(
                "--distribution must be 'data' or 'model' (or left out), got "
                f"{self.distribution!r}"
            )
        if self.data is None or (
            isinstance(self.data, (str, list, tuple)) and not self.data
        ):
            problems.append("--data is required: a prepared directory or text")
        if not self.output_dir:
            problems.append("--output is required")
        try:
            _, hashes = parse_architecture(self.architecture)
        except ValueError as error:
            problems.append(str(error).rstrip("."))
        else:
            if self.model == "mhf" and hashes is None:
                problems.append(
                    f"--architecture {self.architecture} has no hash part; "
                    "an MHF model needs '<trunk>_h<H>b<B>' (e.g. tiny_h3b512)"
                )
        if self.model == "mhf" and _is_int(self.extra_layers):
            if self.extra_layers:
                problems.append(
                    "--extra-layers applies to --model standard (Standard+kL)"
                )
        if self.compilation_cache is not None and not isinstance(
            self.compilation_cache, (str, os.PathLike)
        ):
            problems.append(
                "--compilation-cache must be a directory, 'auto' or 'none', "
                f"got {self.compilation_cache!r}"
            )
        if self.mesh is not None:
            from keras_mhf.distribution import parse_mesh

            try:
                parse_mesh(self.mesh)
            except ValueError as error:
                problems.append(str(error).rstrip("."))
        if problems:
            raise RunConfigError("; ".join(problems) + ".")
        if self.warmup_steps >= self.steps and self.steps > 1:
            warnings.warn(
                f"warmup_steps={self.warmup_steps} >= steps={self.steps}: the "
                f"warmup is shortened to {self.steps - 1} steps.",
                stacklevel=2,
            )


def _flag(name):
    return "--" + name.replace("_", "-")


def _is_finite_number(value):
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


# --- Processes ---------------------------------------------------------------


def process_layout():
    """`(process_index, process_count)` of this process in a multi-process
    JAX job (`keras_mhf.distribution.initialize`); `(0, 1)` otherwise.

    Example:

    >>> process_layout()
    (0, 1)
    """
    if keras.config.backend() != "jax":
        return 0, 1
    import jax

    return jax.process_index(), jax.process_count()


def _is_primary():
    """Only process 0 writes files (checkpoints, log, preset, summary)."""
    return process_layout()[0] == 0


@contextlib.contextmanager
def run_scope(config):
    """Sets the process-wide state the run needs (a distribution for
    `config.distribution`, the `mixed_bfloat16` policy for
    `config.mixed_precision`, on JAX a persistent compilation cache, see
    `compilation_cache_directory`) and restores the previous state
    afterwards.

    In a multi-process JAX job each process feeds only its own rows of every
    global batch, so the distribution's `auto_shard_dataset` is turned off.

    Raises:
        RunConfigError: a batch size the batch axis of the device mesh (or
            the number of processes) does not divide, model parallelism over
            several processes, or several processes without a distribution.

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
                "--distribution data so that the processes train one model."
            )
        if config.distribution == "model":
            raise RunConfigError(
                "Multi-process runs support --distribution data only: "
                "checkpoints are written from weights replicated on every "
                "process, which model parallelism over processes does not "
                "give."
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
            from keras_mhf.distribution import check_batch_size
            from keras_mhf.distribution import make_distribution

            try:
                strategy = make_distribution(config.distribution, config.mesh)
                check_batch_size(config.batch_size, strategy)
            except ValueError as error:
                raise RunConfigError(str(error)) from error
            if process_count > 1:
                strategy.auto_shard_dataset = False
            keras.distribution.set_distribution(strategy)
        if config.mixed_precision:
            keras.config.set_dtype_policy("mixed_bfloat16")
        yield
    finally:
        keras.config.set_dtype_policy(previous_policy)
        if config.distribution is not None:
            keras.distribution.set_distribution(previous_distribution)
        cache.close()


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


# --- Data ---------------------------------------------------------------------


@dataclasses.dataclass
class RunData:
    """What `load_data` produces: the tokenizer, the prepared corpus the
    training windows stream from, and the fixed validation windows.

    Example:

    ```python
    data = load_data(config)
    data.fingerprint  # sha256 of the corpus's token streams
    ```
    """

    tokenizer_path: str
    tokenizer: MultiHashFormerTokenizer
    corpus: PreparedCorpus
    validation_blocks: np.ndarray

    @property
    def fingerprint(self):
        return corpus_fingerprint(self.corpus)


def corpus_fingerprint(corpus):
    """sha256 of what defines a prepared corpus's token streams: the
    tokenizer's sha256, the token dtype and every shard's sha256 and size
    (all read from `index.json`, so nothing is re-hashed).

    Example:

    ```python
    corpus_fingerprint(PreparedCorpus("prepared/openstax"))[:12]
    ```
    """
    index = corpus.index
    identity = {
        "tokenizer": index["tokenizer"]["sha256"],
        "dtype": index["dtype"],
        "splits": {
            split: [
                [shard["sha256"], shard["tokens"]]
                for shard in index["splits"][split]["shards"]
            ]
            for split in ("train", "validation")
        },
    }
    text = json.dumps(identity, sort_keys=True).encode("utf-8")
    return hashlib.sha256(text).hexdigest()


def is_prepared_directory(data):
    """Whether `data` is a directory written by `prepare_data` (it holds
    `index.json`, complete or not) rather than raw text.

    Example:

    ```python
    is_prepared_directory("prepared/openstax")  # True
    ```
    """
    from keras_mhf.data.prepared_corpus import STATE_FILE as PREPARE_STATE

    if not isinstance(data, (str, os.PathLike)) or not os.path.isdir(data):
        return False
    return any(
        os.path.exists(os.path.join(data, name))
        for name in (INDEX_FILE, PREPARE_STATE)
    )


def _open_corpus(directory):
    try:
        return PreparedCorpus(directory)
    except (ValueError, FileNotFoundError) as error:
        raise RunConfigError(str(error)) from error


def _tokenizer_for_prepared(config, corpus):
    """The tokenizer file of a prepared corpus: `config.tokenizer` (checked
    against the corpus) or the file recorded in `index.json`."""
    if config.tokenizer is not None:
        if not os.path.isfile(config.tokenizer):
            raise RunConfigError(f"No such tokenizer file: {config.tokenizer}")
        try:
            corpus.check_tokenizer(config.tokenizer)
        except ValueError as error:
            raise RunConfigError(
                f"--tokenizer {config.tokenizer} is not the tokenizer "
                f"{corpus.directory} was prepared with: {error} Or pass the "
                f"tokenizer it was prepared with ({_recorded(corpus)})."
            ) from error
        return config.tokenizer
    recorded = corpus.index["tokenizer"].get("path")
    if recorded and os.path.isfile(recorded):
        if tokenizer_fingerprint(recorded) == corpus.tokenizer_fingerprint:
            return recorded
        problem = f"{recorded} has changed since (its sha256 differs)"
    else:
        problem = f"{recorded} no longer exists"
    raise RunConfigError(
        f"{corpus.directory} was prepared with the tokenizer {recorded}, but "
        f"{problem}; pass --tokenizer with the .model file it was prepared "
        f"with (sha256 {corpus.tokenizer_fingerprint[:16]}...)."
    )


def _recorded(corpus):
    return corpus.index["tokenizer"].get("path") or "path not recorded"


def _prepare_raw_text(config):
    """Prepares raw text into `OUTPUT/data/` (a no-op that only checks the
    inputs when a complete prepared corpus is already there) and returns
    `(tokenizer path, prepared directory)`."""
    try:
        list_corpus_files(config.data)
        if config.validation_data is not None:
            list_corpus_files(config.validation_data)
    except (ValueError, FileNotFoundError) as error:
        raise RunConfigError(str(error)) from error
    if config.tokenizer is not None and not os.path.isfile(config.tokenizer):
        raise RunConfigError(f"No such tokenizer file: {config.tokenizer}")
    prepared = config.path("data")
    if _is_primary():
        os.makedirs(config.output_dir, exist_ok=True)
    tokenizer_path = config.tokenizer
    if tokenizer_path is None:
        tokenizer_path = config.path("tokenizer.model")
        if not os.path.exists(tokenizer_path):
            if config.verbose:
                print(
                    f"Training a {config.vocabulary_size}-piece tokenizer on "
                    "at most the first "
                    f"{TOKENIZER_SAMPLE_DOCUMENTS:,} training documents / "
                    f"{TOKENIZER_SAMPLE_CHARACTERS:,} characters."
                )
            exclude = None
            if config.validation_data is None:
                fraction = config.validation_fraction

                def exclude(text):  # held out: the tokenizer never sees it
                    return validation_score(text) < fraction

            sample = tokenizer_training_sample(
                read_documents(config.data), exclude=exclude
            )
            train_sentencepiece(sample, config.vocabulary_size, tokenizer_path)
    if os.path.exists(os.path.join(prepared, INDEX_FILE)):
        if config.verbose:
            print(f"Using the prepared corpus in {prepared}.")
    elif config.verbose:
        print(f"Preparing the training text into {prepared} (resumable).")
    try:
        prepare_data(
            config.data,
            tokenizer_path,
            prepared,
            validation_fraction=config.validation_fraction,
            validation_inputs=config.validation_data,
            workers=config.workers,
            progress=bool(config.verbose),
        )
    except ValueError as error:
        raise RunConfigError(
            f"{error} (preparing --data into {prepared})"
        ) from error
    return tokenizer_path, prepared


def load_data(config):
    """Step "data": the tokenizer, the prepared corpus and the validation
    windows.

    `config.data` is either a prepared directory (`index.json`; nothing is
    written) or raw text (files, directories, glob patterns or a list),
    which is first prepared into `OUTPUT/data/` with
    `keras_mhf.data.prepare_data`; a rerun finds it complete and tokenizes
    nothing again. Without `config.tokenizer`, raw text gets a tokenizer
    trained on a bounded sample of its training documents
    (`OUTPUT/tokenizer.model`), and a prepared directory uses the tokenizer
    file recorded in its index if it still has the recorded sha256.

    Raises:
        RunConfigError: a tokenizer that does not match the corpus, a
            missing tokenizer, `validation_data` with a prepared directory,
            or a split shorter than one window of `sequence_length + 1`.

    Example:

    ```python
    data = load_data(RunConfig("prepared/openstax", "runs/mhf"))
    data.corpus.num_tokens("train"), data.validation_blocks.shape
    ```
    """
    if is_prepared_directory(config.data):
        if config.validation_data is not None:
            raise RunConfigError(
                f"--validation-data applies to raw text; {config.data} is a "
                "prepared corpus with its own validation split (set it with "
                "tools/prepare_data.py --validation)."
            )
        corpus = _open_corpus(config.data)
        tokenizer_path = _tokenizer_for_prepared(config, corpus)
    else:
        if process_layout()[1] > 1:
            raise RunConfigError(
                "A multi-process run needs a prepared --data directory (the "
                "processes must not prepare raw text at the same time); run "
                "tools/prepare_data.py first and pass its output."
            )
        tokenizer_path, prepared = _prepare_raw_text(config)
        corpus = _open_corpus(prepared)
    for split in ("train", "validation"):
        tokens = corpus.num_tokens(split)
        if tokens < config.sequence_length + 1:
            raise RunConfigError(
                f"The {split} split of {corpus.directory} has {tokens} tokens, "
                "fewer than one window of --sequence-length + 1 = "
                f"{config.sequence_length + 1}; use a shorter "
                "--sequence-length or more data."
            )
    blocks = validation_windows(
        corpus, config.sequence_length, count=config.validation_blocks
    )
    return RunData(
        tokenizer_path,
        MultiHashFormerTokenizer(tokenizer_path),
        corpus,
        blocks,
    )


# --- Model --------------------------------------------------------------------


def build_run_model(config, tokenizer):
    """Step "model": the seeded model, compiled with the run's optimizer.

    Example:

    ```python
    lm = build_run_model(config, load_data(config).tokenizer)
    ```
    """
    keras.utils.set_random_seed(config.seed)
    lm = build_model(
        config.model,
        tokenizer,
        config.architecture,
        config.sequence_length,
        config.extra_layers,
        config.signature_rule,
    )
    optimizer = make_optimizer(
        config.learning_rate,
        config.steps,
        config.warmup_steps,
        config.weight_decay,
    )
    lm.compile(optimizer=optimizer)
    return lm


# --- Checkpoints ----------------------------------------------------------


def run_settings(config, data):
    """The settings a checkpoint must share with the run that resumes it:
    they decide the model, the data of every step and the schedule's
    length. (The optimizer's learning rate, warmup and weight decay may
    change on resume, e.g. to continue a diverged run more gently.)

    Example:

    ```python
    run_settings(config, data)["batch_size"]  # == config.batch_size
    ```
    """
    return {
        "model": config.model,
        "architecture": config.architecture,
        "extra_layers": config.extra_layers,
        "signature_rule": config.signature_rule,
        "sequence_length": config.sequence_length,
        "batch_size": config.batch_size,
        "steps": config.steps,
        "seed": config.seed,
        "mixed_precision": bool(config.mixed_precision),
        "data": data.fingerprint,
    }


def _optimizer_settings(config):
    return {
        "learning_rate": config.learning_rate,
        "warmup_steps": config.warmup_steps,
        "weight_decay": config.weight_decay,
    }


def checkpoint_directory(config, step):
    """`OUTPUT/checkpoints/step_NNNNNN` of a global step.

    Example:

    ```python
    checkpoint_directory(config, 4)  # "runs/mhf/checkpoints/step_000004"
    ```
    """
    return os.path.join(config.path(CHECKPOINTS), f"step_{step:06d}")


def list_checkpoints(config):
    """`[(step, directory)]` of the checkpoint directories (complete by
    construction: only an atomic rename gives them their name), newest
    first.

    Example:

    ```python
    [step for step, _ in list_checkpoints(config)]  # e.g. [300, 250]
    ```
    """
    root = config.path(CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _CHECKPOINT_NAME.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def read_checkpoint(directory):
    """The run state of a checkpoint directory, after checking that its
    weights file has the size and sha256 the state records.

    Raises:
        CheckpointError: unreadable state, or weights that are missing,
            truncated or damaged.

    Example:

    ```python
    read_checkpoint("runs/mhf/checkpoints/step_000300")["step"]  # 300
    ```
    """
    state_path = os.path.join(directory, STATE_FILE)
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"its {STATE_FILE} is unreadable ({error})")
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"its {STATE_FILE} is not a checkpoint state")
    if state.get("format_version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"it has format version {state.get('format_version')!r}, this "
            f"keras_mhf reads {CHECKPOINT_VERSION}"
        )
    weights = os.path.join(directory, state["weights"]["file"])
    if not os.path.isfile(weights):
        raise CheckpointError(f"{weights} is missing")
    size = os.path.getsize(weights)
    if size != state["weights"]["bytes"]:
        raise CheckpointError(
            f"{weights} has {size} bytes, the state records "
            f"{state['weights']['bytes']} (truncated or damaged)"
        )
    if _file_sha256(weights) != state["weights"]["sha256"]:
        raise CheckpointError(
            f"{weights} does not match the sha256 its state records (damaged)"
        )
    return state


def latest_checkpoint(config):
    """`(directory, state)` of the newest usable checkpoint, or `None` when
    there is none.

    An unusable newer checkpoint (damaged weights, unreadable state) is
    renamed `step_NNNNNN.unusable` with a warning naming it, and the previous
    one is used.

    Raises:
        CheckpointError: checkpoints exist but none is usable.

    Example:

    ```python
    found = latest_checkpoint(config)
    step = found[1]["step"] if found else 0
    ```
    """
    unusable = []
    for step, directory in list_checkpoints(config):
        try:
            state = read_checkpoint(directory)
        except CheckpointError as error:
            unusable.append(f"{directory}: {error}")
            aside = directory + _UNUSABLE_SUFFIX
            if _is_primary():
                if os.path.exists(aside):
                    shutil.rmtree(aside)
                os.replace(directory, aside)
            warnings.warn(
                f"The checkpoint {directory} (step {step}) is unusable "
                f"({error}); it was moved to {aside} and the previous "
                "complete checkpoint is used instead.",
                stacklevel=2,
            )
            continue
        return directory, state
    if unusable:
        raise CheckpointError(
            f"{config.output_dir} holds checkpoints, but none can be loaded: "
            + "; ".join(unusable)
            + ". Nothing was loaded. Use a new --output, or delete "
            f"{config.path(CHECKPOINTS)} to train from scratch."
        )
    return None


def _remove_stale(config):
    """Removes temporary checkpoint directories that a killed run left."""
    root = config.path(CHECKPOINTS)
    if not os.path.isdir(root) or not _is_primary():
        return
    for name in os.listdir(root):
        if name.startswith(_TEMPORARY_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _differences(found, wanted):
    keys = [k for k in wanted if found.get(k) != wanted[k]]
    return "; ".join(
        f"{k}: {str(found.get(k))[:16]} in the checkpoint, now "
        f"{str(wanted[k])[:16]}"
        for k in keys
    )


def _trim_log(config, step):
    """Keeps the rows of `log.csv` up to `step` (a run killed after its log
    line and before its checkpoint logged steps it will run again)."""
    log_path = config.path("log.csv")
    if not os.path.exists(log_path) or not _is_primary():
        return
    with open(log_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if int(r["step"]) <= step]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=LOG_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    _write_atomically(log_path, text.getvalue().encode("utf-8"))


def resume(config, lm, data):
    """Step "resume": loads the newest complete checkpoint of
    `config.output_dir` into `lm` (weights and optimizer state) and returns
    the global step to continue from (0 for a new run).

    Raises:
        RunConfigError: the checkpoint belongs to a run with other settings
            (see `run_settings`), or the directory holds a checkpoint of an
            earlier keras_mhf layout.
        CheckpointError: there are checkpoints but none is usable.

    Example:

    ```python
    lm = build_run_model(config, data.tokenizer)
    step = resume(config, lm, data)  # 0, or the newest checkpoint's step
    ```
    """
    if os.path.exists(config.path("checkpoint.json")):
        raise RunConfigError(
            f"{config.output_dir} holds a checkpoint of an earlier keras_mhf "
            "version (checkpoint.json, checkpoint.weights.h5), which this "
            "version cannot resume; use a new --output."
        )
    _remove_stale(config)
    found = latest_checkpoint(config)
    if found is None:
        _check_same_step_everywhere(0)
        if os.path.exists(config.path("log.csv")) and _is_primary():
            os.remove(config.path("log.csv"))
        return 0
    directory, state = found
    _check_same_step_everywhere(state["step"])
    wanted = run_settings(config, data)
    if state["settings"] != wanted:
        raise RunConfigError(
            f"{config.output_dir} holds a checkpoint (step {state['step']}) "
            "of a run with different settings ("
            + _differences(state["settings"], wanted)
            + "). Rerun with the settings it was made with to resume it, or "
            "use a new --output."
        )
    changed = _differences(state["optimizer"], _optimizer_settings(config))
    if changed:
        warnings.warn(
            f"Resuming from step {state['step']} with other optimizer "
            f"settings ({changed}); the run is no longer the same as an "
            "uninterrupted one.",
            stacklevel=2,
        )
    lm.optimizer.build(lm.trainable_variables)
    lm.load_weights(os.path.join(directory, state["weights"]["file"]))
    _trim_log(config, state["step"])
    if config.verbose:
        print(f"Resuming from step {state['step']} ({directory}).")
    return state["step"]


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


@contextlib.contextmanager
def _writing_alone():
    """Lets process 0 save while the other processes go on: in a
    multi-process job, creating a variable under a distribution is a
    collective operation (and Keras' saving creates one), so the save runs
    without the distribution. The weights are replicated on every process,
    so process 0 reads them all locally."""
    if process_layout()[1] == 1:
        yield
        return
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(previous)


def _non_finite_variables(lm):
    """Paths of model and optimizer variables holding NaN or infinity."""
    variables = list(lm.weights)
    if lm.optimizer is not None:
        variables += list(lm.optimizer.variables)
    bad = []
    for variable in variables:
        value = np.asarray(keras.ops.convert_to_numpy(variable.value))
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            bad.append(variable.path)
    return bad


def _check_finite(config, lm, step, what):
    bad = _non_finite_variables(lm)
    if bad:
        kept = latest_checkpoint(config)
        raise NonFiniteWeightsError(
            f"the weights became non-finite by step {step} ({len(bad)} "
            f"variables, e.g. {bad[0]}) although the training loss stayed "
            f"finite; no {what} was written from them. "
            + _what_now(config, kept),
            step,
            kept[0] if kept else None,
        )


def _what_now(config, kept):
    return (
        _kept_message(kept) + " Rerun with a lower --learning-rate (it was "
        f"{config.learning_rate:g}) to resume from "
        + ("there" if kept else "the start")
        + ", or start again with a new --output."
    )


def _kept_message(kept):
    if kept is None:
        return "No checkpoint had been written yet."
    directory, state = kept
    return (
        f"The last finite checkpoint (step {state['step']}) is kept in "
        f"{directory}."
    )


def save_checkpoint(config, lm, data, step, train_loss=None):
    """Step "checkpoint": writes weights (model and optimizer state) and the
    run state as one directory, atomically, then prunes older checkpoints
    (the last `KEEP_CHECKPOINTS` are kept). Only process 0 writes.

    The directory is written as `checkpoints/.tmp-step_NNNNNN-PID/`
    (`model.weights.h5`, then `state.json` with the weights' size and
    sha256), flushed to disk, and renamed `checkpoints/step_NNNNNN/`.

    Raises:
        NonFiniteWeightsError: a weight is NaN or infinite (nothing is
            written).

    Returns:
        The checkpoint directory.

    Example:

    ```python
    save_checkpoint(config, lm, data, step=100)  # .../step_000100
    ```
    """
    _check_finite(config, lm, step, "checkpoint")
    final = checkpoint_directory(config, step)
    if not _is_primary():
        return final
    root = config.path(CHECKPOINTS)
    os.makedirs(root, exist_ok=True)
    temporary = os.path.join(
        root, f"{_TEMPORARY_PREFIX}{os.path.basename(final)}-{os.getpid()}"
    )
    if os.path.exists(temporary):
        shutil.rmtree(temporary)
    os.makedirs(temporary)
    weights = os.path.join(temporary, WEIGHTS_FILE)
    with _writing_alone():
        lm.save_weights(weights)
    _event("weights_written", path=weights)
    _fsync_file(weights)
    state = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "step": step,
        "chunk": math.ceil(step / config.checkpoint_every),
        "tokens_seen": step * config.batch_size * config.sequence_length,
        "train_loss": None if train_loss is None else float(train_loss),
        "settings": run_settings(config, data),
        "optimizer": _optimizer_settings(config),
        "weights": {
            "file": WEIGHTS_FILE,
            "bytes": os.path.getsize(weights),
            "sha256": _file_sha256(weights),
        },
    }
    _write_atomically(
        os.path.join(temporary, STATE_FILE),
        json.dumps(state, indent=1).encode("utf-8"),
    )
    _fsync_directory(temporary)
    _event("checkpoint_complete", path=temporary)
    if os.path.exists(final):  # only an unusable leftover can be there
        shutil.rmtree(final)
    os.replace(temporary, final)
    _fsync_directory(root)
    _event("checkpoint_renamed", path=final)
    for _, old in list_checkpoints(config)[KEEP_CHECKPOINTS:]:
        doomed = os.path.join(
            root, f"{_TEMPORARY_PREFIX}prune-{os.path.basename(old)}"
        )
        os.replace(old, doomed)  # atomic: never seen half deleted
        shutil.rmtree(doomed)
    return final


# --- Training ---------------------------------------------------------------


class StopOnNonFiniteLoss(keras.callbacks.Callback):
    """Stops `fit` after the first batch whose training loss is NaN or
    infinite and records its global step (like Keras' `TerminateOnNaN`).

    Args:
        first_step: the global step before the first batch of this `fit`.

    Example:

    ```python
    guard = StopOnNonFiniteLoss(first_step=100)
    lm.fit(dataset, callbacks=[guard])
    if guard.step is not None:
        print("diverged at step", guard.step)
    ```
    """

    def __init__(self, first_step):
        super().__init__()
        self.first_step = first_step
        self.step = None
        self.loss = None

    def on_train_batch_end(self, batch, logs=None):
        step = self.first_step + batch + 1
        _event("train_step", step=step)
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        # `loss` is the running mean of this fit call: it turns non-finite
        # at the first non-finite batch loss.
        value = float(np.asarray(keras.ops.convert_to_numpy(loss)))
        if not math.isfinite(value) and self.step is None:
            self.step, self.loss = step, value
            self.model.stop_training = True


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


def train_chunk(config, lm, data, first, last):
    """Step "one chunk": one `fit` call over the windows of global steps
    `(first, last]` (`window_dataset` from `first`); returns the history.

    Each process of a multi-process job reads only its own rows of every
    global batch.

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
    ).to_iter_dataset(loader_options())
    guard = StopOnNonFiniteLoss(first)
    preprocessor = lm.preprocessor
    lm.preprocessor = None  # the dataset yields token ids
    try:
        history = lm.fit(
            dataset,
            epochs=1,
            steps_per_epoch=last - first,
            shuffle=False,
            verbose=config.verbose if _is_primary() else 0,
            callbacks=[guard],
        )
    finally:
        lm.preprocessor = preprocessor
    if guard.step is not None:
        kept = latest_checkpoint(config)
        raise NonFiniteLossError(
            f"the training loss became non-finite ({guard.loss}) at step "
            f"{guard.step}; training stopped there and no checkpoint, preset "
            "or summary was written from the diverged weights. "
            + _what_now(config, kept),
            guard.step,
            kept[0] if kept else None,
        )
    _check_finite(config, lm, last, "checkpoint or log line")
    return history


def write_log_row(config, lm, data, history, step, started):
    """Step "log": scores the validation windows (perplexity over the real
    vocabulary, `keras_mhf.evaluation.perplexity`) and appends a row to
    `log.csv` (`step`, `tokens`: training tokens seen so far, losses,
    learning rate, seconds); returns the row.

    Example:

    ```python
    row = write_log_row(config, lm, data, history, 150, time.time())
    ```
    """
    metrics = perplexity(lm, data.validation_blocks, config.batch_size)
    row = {
        "step": step,
        "tokens": step * config.batch_size * config.sequence_length,
        "train_loss": history.history["loss"][-1],
        "val_loss": metrics["loss"],
        "val_perplexity": metrics["perplexity"],
        "val_accuracy": metrics["accuracy"],
        "learning_rate": float(
            keras.ops.convert_to_numpy(lm.optimizer.learning_rate)
        ),
        "seconds": round(time.time() - started, 1),
    }
    if _is_primary():
        log_path = config.path("log.csv")
        new_file = not os.path.exists(log_path)
        with open(log_path, "a", newline="") as f:
            writer = csv.DictWriter(
                f, fieldnames=LOG_FIELDS, lineterminator="\n"
            )
            if new_file:
                writer.writeheader()
            writer.writerow(row)
    if config.verbose:
        print(
            f"step {step}: train loss {row['train_loss']:.3f}, validation "
            f"perplexity {row['val_perplexity']:.2f} (over the real vocabulary)"
        )
    return row


def finish(config, lm, data, step):
    """Step "finish": for a run that reached `config.steps`, writes the
    preset (atomically), `summary.json` and `loss.png`, and returns the
    summary (without them for an unfinished run). Steps that act on the
    final model (e.g. calibration) belong here, before the preset.

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
    _check_finite(config, lm, step, "preset or summary")
    summary["validation"] = perplexity(
        lm, data.validation_blocks, config.batch_size
    )
    if not _is_primary():
        return summary
    preset = config.path("preset")
    _save_preset(lm, preset)
    summary["preset"] = os.path.abspath(preset)
    plot = plot_log(config.path("log.csv"), config.path("loss.png"))
    if plot:
        summary["plot"] = os.path.abspath(plot)
    _write_atomically(
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
    with _writing_alone():
        lm.save_to_preset(temporary)
    for root, _, names in os.walk(temporary):
        for name in names:
            _fsync_file(os.path.join(root, name))
    _fsync_directory(temporary)
    if os.path.exists(preset):
        old = f"{preset}.old-{os.getpid()}"
        os.replace(preset, old)
        os.replace(temporary, preset)
        shutil.rmtree(old)
    else:
        os.replace(temporary, preset)
    _fsync_directory(parent)


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
            windows are scored at every checkpoint), `checkpoint_every`
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
        `(lm, summary)`: the trained model and the summary dict (also
        written to `summary.json` when the run finished).

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
        if _is_primary():
            os.makedirs(config.output_dir, exist_ok=True)
        lm = build_run_model(config, run_data.tokenizer)
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
            history = train_chunk(config, lm, run_data, step, last)
            write_log_row(config, lm, run_data, history, last, started)
            save_checkpoint(
                config, lm, run_data, last, history.history["loss"][-1]
            )
            step, chunks = last, chunks + 1
        summary = finish(config, lm, run_data, step)
    return lm, summary


# --- Files ----------------------------------------------------------------


def _file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_directory(path):
    """Flushes a directory entry (a rename) to disk where the platform
    allows opening directories."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _write_atomically(path, data):
    """Writes bytes to `path` through a flushed temporary file and a
    rename, so `path` holds either its old or its new content."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def plot_log(log_path, png_path):
    """Train/validation loss against tokens, as a PNG (needs matplotlib).

    Example:

    ```python
    plot_log("runs/mhf/log.csv", "runs/mhf/loss.png")
    ```
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not os.path.exists(log_path):
        return None
    with open(log_path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    tokens = [int(r["tokens"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        tokens,
        [float(r["train_loss"]) for r in rows],
        "o-",
        label="train loss (model objective)",
    )
    ax.plot(
        tokens,
        [float(r["val_loss"]) for r in rows],
        "s-",
        label="validation NLL per token",
    )
    ax.set_xlabel("training tokens")
    ax.set_ylabel("nats")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
