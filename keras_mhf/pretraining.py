"""Pre-training with `model.fit`: the engine behind `recipes/pretrain.py`.

`pretrain` runs named steps: `load_data` (tokenizer and token blocks),
`build_run_model` (model and optimizer), `resume` (the last checkpoint, if
any), then, for each chunk of `checkpoint_every` optimizer steps,
`train_chunk` (one `fit` call on a deterministic slice of the data order),
`write_log_row` and `save_checkpoint`, and finally `finish` (preset,
summary, plot). A run killed at any point resumes from its last checkpoint
and ends with the same weights as an uninterrupted run. Process-wide Keras
state that a run needs (a distribution, a dtype policy) is set for the run
only and restored afterwards.
"""

import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import time

import keras
import numpy as np

from keras_mhf.data import blocks_to_features
from keras_mhf.data import pack_documents
from keras_mhf.data import read_documents
from keras_mhf.evaluation import perplexity
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


def train_sentencepiece(documents, vocabulary_size, path):
    """Trains a byte-fallback BPE SentencePiece model (`<unk>`, `<s>`,
    `</s>` at ids 0-2, like Mistral's) and writes it to `path`."""
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
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def make_optimizer(learning_rate, total_steps, warmup_steps, weight_decay=0.1):
    """AdamW, linear warmup then cosine decay to 0, global-norm clipping 1.0,
    weight decay on kernels and tables only (not on norms or biases)."""
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
    """A new MHF (`kind="mhf"`) or Standard (`"standard"`) causal LM."""
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
    """One `fit` pass over packed `[n, L+1]` blocks, in the given order."""
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
    """Sample indices for the whole run: shuffled passes over the blocks."""
    rng = np.random.default_rng(seed)
    passes = math.ceil(total_samples / num_blocks)
    return np.concatenate([rng.permutation(num_blocks) for _ in range(passes)])[
        :total_samples
    ]


@dataclasses.dataclass
class RunConfig:
    """The settings of one pre-training run (see `pretrain` for each)."""

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
    max_tokens: int = None
    mixed_precision: bool = False
    seed: int = 0
    distribution: str = None
    mesh: object = None
    verbose: int = 1

    @property
    def chunks(self):
        return math.ceil(self.steps / self.checkpoint_every)

    def path(self, name):
        return os.path.join(self.output_dir, name)


@dataclasses.dataclass
class RunData:
    """What `load_data` produces: the tokenizer and the packed blocks."""

    tokenizer_path: str
    tokenizer: MultiHashFormerTokenizer
    train_blocks: np.ndarray
    validation_blocks: np.ndarray


@contextlib.contextmanager
def run_scope(config):
    """Sets the process-wide Keras state the run needs (a distribution for
    `config.distribution`, the `mixed_bfloat16` policy for
    `config.mixed_precision`) and restores the previous state afterwards."""
    previous_policy = keras.config.dtype_policy()
    previous_distribution = keras.distribution.distribution()
    try:
        if config.distribution is not None:
            from keras_mhf.distribution import check_batch_size
            from keras_mhf.distribution import make_distribution

            strategy = make_distribution(config.distribution, config.mesh)
            check_batch_size(config.batch_size, strategy)
            keras.distribution.set_distribution(strategy)
        if config.mixed_precision:
            keras.config.set_dtype_policy("mixed_bfloat16")
        yield
    finally:
        keras.config.set_dtype_policy(previous_policy)
        if config.distribution is not None:
            keras.distribution.set_distribution(previous_distribution)


def load_data(config):
    """Step "data": reads the documents, trains or opens the tokenizer and
    packs training and validation blocks of `sequence_length + 1` tokens."""
    import sentencepiece as spm

    documents = list(read_documents(config.data))
    if config.validation_data is not None:
        train_documents = documents
        validation_documents = list(read_documents(config.validation_data))
    else:
        if len(documents) < 2:
            raise ValueError("Need at least two documents to hold one out.")
        held_out = max(1, int(len(documents) * config.validation_fraction))
        train_documents = documents[:-held_out]
        validation_documents = documents[-held_out:]
    if config.tokenizer is None:
        tokenizer_path = config.path("tokenizer.model")
        if not os.path.exists(tokenizer_path):
            train_sentencepiece(
                train_documents, config.vocabulary_size, tokenizer_path
            )
    else:
        tokenizer_path = config.tokenizer
    tokenizer = MultiHashFormerTokenizer(tokenizer_path)
    sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
    bos = tokenizer.start_token_id
    train_blocks = pack_documents(
        train_documents,
        sp.encode,
        bos,
        config.sequence_length,
        config.max_tokens,
    )
    validation_blocks = pack_documents(
        validation_documents, sp.encode, bos, config.sequence_length
    )[: config.validation_blocks]
    return RunData(tokenizer_path, tokenizer, train_blocks, validation_blocks)


def build_run_model(config, tokenizer):
    """Step "model": the seeded model, compiled with the run's optimizer."""
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


def resume(config, lm):
    """Step "resume": loads the last checkpoint of `config.output_dir` into
    `lm` and returns the first chunk still to run (0 for a new run)."""
    checkpoint = config.path("checkpoint.weights.h5")
    state_path = config.path("checkpoint.json")
    if not (os.path.exists(state_path) and os.path.exists(checkpoint)):
        if os.path.exists(config.path("log.csv")):
            os.remove(config.path("log.csv"))
        return 0
    with open(state_path) as f:
        state = json.load(f)
    if (
        state.get("steps") != config.steps
        or state.get("batch_size") != config.batch_size
    ):
        raise ValueError(
            f"{config.output_dir} holds a checkpoint of a run with different "
            f"steps/batch_size ({state}); use a new output directory."
        )
    lm.optimizer.build(lm.trainable_variables)
    lm.load_weights(checkpoint)
    if config.verbose:
        print(f"Resuming from step {state['step']} ({checkpoint}).")
    return state["chunk"]


def chunk_steps(config, chunk):
    """The optimizer steps `(first, last]` of a chunk."""
    first = chunk * config.checkpoint_every
    return first, min(config.steps, first + config.checkpoint_every)


def train_chunk(config, lm, data, order, chunk):
    """Step "one chunk": one `fit` call over the chunk's slice of the data
    order; returns the training history."""
    first, last = chunk_steps(config, chunk)
    if config.verbose:
        print(f"Steps {first + 1}-{last} of {config.steps}")
    indices = order[first * config.batch_size : last * config.batch_size]
    return fit_blocks(
        lm, data.train_blocks[indices], config.batch_size, config.verbose
    )


def write_log_row(config, lm, data, history, chunk, started):
    """Step "log": scores validation perplexity and appends a row to
    `log.csv`; returns the row."""
    _, last = chunk_steps(config, chunk)
    metrics = perplexity(lm, data.validation_blocks, config.batch_size)
    row = {
        "step": last,
        "tokens": last * config.batch_size * config.sequence_length,
        "train_loss": history.history["loss"][-1],
        "val_loss": metrics["loss"],
        "val_perplexity": metrics["perplexity"],
        "val_accuracy": metrics["accuracy"],
        "learning_rate": float(
            keras.ops.convert_to_numpy(lm.optimizer.learning_rate)
        ),
        "seconds": round(time.time() - started, 1),
    }
    log_path = config.path("log.csv")
    new_file = not os.path.exists(log_path)
    with open(log_path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=LOG_FIELDS)
        if new_file:
            writer.writeheader()
        writer.writerow(row)
    if config.verbose:
        print(
            f"step {last}: train loss {row['train_loss']:.3f}, validation "
            f"perplexity {row['val_perplexity']:.2f} (over the real vocabulary)"
        )
    return row


def save_checkpoint(config, lm, chunk):
    """Saves weights and optimizer state, and the chunk count."""
    _, last = chunk_steps(config, chunk)
    lm.save_weights(config.path("checkpoint.weights.h5"))
    with open(config.path("checkpoint.json"), "w") as f:
        json.dump(
            {
                "chunk": chunk + 1,
                "step": last,
                "steps": config.steps,
                "batch_size": config.batch_size,
            },
            f,
        )


def finish(config, lm, data):
    """Writes the preset, `summary.json` and `loss.png` of a finished run
    and returns the summary (without them for an unfinished one)."""
    state_path = config.path("checkpoint.json")
    finished = False
    if os.path.exists(state_path):
        with open(state_path) as f:
            finished = json.load(f)["chunk"] >= config.chunks
    summary = {
        "model": config.model,
        "architecture": config.architecture,
        "parameters": count_trainable_parameters(lm),
        "train_tokens_available": int(data.train_blocks.size),
        "steps": config.steps,
        "finished": finished,
        "tokenizer": os.path.abspath(data.tokenizer_path),
        "log": os.path.abspath(config.path("log.csv")),
    }
    if finished:
        preset = config.path("preset")
        lm.save_to_preset(preset)
        summary["preset"] = os.path.abspath(preset)
        summary["validation"] = perplexity(
            lm, data.validation_blocks, config.batch_size
        )
        plot = plot_log(config.path("log.csv"), config.path("loss.png"))
        if plot:
            summary["plot"] = os.path.abspath(plot)
        with open(config.path("summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def pretrain(data, output_dir, stop_after_chunks=None, **settings):
    """Trains a MultiHashFormer (or the Standard baseline) with `model.fit`.

    Args:
        data: a `.txt`/`.jsonl` file, a directory of them, or a list.
        output_dir: where the tokenizer, checkpoints, `log.csv`, `loss.png`,
            `summary.json` and the final preset (`preset/`) go.
        stop_after_chunks: stop (as if killed) after this many chunks of
            this call; for testing resumption.
        **settings: the fields of `RunConfig`:
            `tokenizer` (path to a SentencePiece `.model`; if `None`, one with
            `vocabulary_size` pieces is trained on the training text),
            `model` (`"mhf"` or `"standard"`), `architecture` (e.g.
            `"mini_h4b1024"`), `extra_layers` (Standard+kL),
            `signature_rule` (`"unique"`, `"reference"`, or `"repeated"` for
            the single-ID ablation), `sequence_length`, `batch_size`,
            `steps` (optimizer steps), `learning_rate` (peak),
            `warmup_steps`, `weight_decay` (not on norms and biases),
            `validation_data` (held-out file/directory; if `None`, the last
            `validation_fraction` of the documents), `validation_blocks` (at
            most this many held-out blocks are scored), `checkpoint_every`
            (steps per chunk: validation, log line and checkpoint after each),
            `max_tokens` (cap on training tokens), `mixed_precision`
            (`mixed_bfloat16` for this run), `seed` (seeds Keras' global
            random state, the weights and the data order), `distribution`
            (`None`, `"data"` or `"model"`: all devices with
            `keras.distribution`, JAX only; other backends are refused),
            `mesh` (`(batch, model)` sizes or `"2x4"`) and `verbose`.

    Returns:
        `(lm, summary)`: the trained model and the summary dict (also
        written to `summary.json` when the run finished).

    Example:

    ```python
    lm, summary = keras_mhf.pretraining.pretrain(
        "corpus.txt", "runs/mhf", architecture="tiny_h3b512", steps=100
    )
    ```
    """
    config = RunConfig(data=data, output_dir=output_dir, **settings)
    with run_scope(config):
        os.makedirs(config.output_dir, exist_ok=True)
        run_data = load_data(config)
        lm = build_run_model(config, run_data.tokenizer)
        order = data_order(
            len(run_data.train_blocks),
            config.steps * config.batch_size,
            config.seed,
        )
        start_chunk = resume(config, lm)
        started = time.time()
        for chunk in range(start_chunk, config.chunks):
            if (
                stop_after_chunks is not None
                and chunk - start_chunk >= stop_after_chunks
            ):
                break
            history = train_chunk(config, lm, run_data, order, chunk)
            write_log_row(config, lm, run_data, history, chunk, started)
            save_checkpoint(config, lm, chunk)
        summary = finish(config, lm, run_data)
    return lm, summary


def plot_log(log_path, png_path):
    """Train/validation loss against tokens, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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
