"""Pre-training with `model.fit`: the engine behind `recipes/pretrain.py`.

The run is cut into chunks of `checkpoint_every` optimizer steps. Each chunk
is one `fit` call on a deterministic slice of the data order; after each
chunk the weights and optimizer state are saved with the step count, so a
run killed at any point resumes from its last checkpoint and ends with the
same weights as an uninterrupted run.
"""

import csv
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
                f"vocabulary_size={vocabulary_size} is too small for this text: "
                "byte fallback needs 256 byte pieces plus one piece per frequent "
                f"character ({error}). Use a larger vocabulary_size."
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


def build_model(kind, tokenizer, architecture, sequence_length, extra_layers=0,
                signature_rule="unique"):
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import standard_causal_lm

    if kind == "mhf":
        return MultiHashFormerCausalLM.from_tokenizer(
            tokenizer, architecture, sequence_length=sequence_length,
            signature_rule=signature_rule,
        )
    if kind == "standard":
        return standard_causal_lm(
            tokenizer, architecture, extra_layers=extra_layers,
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
            x, y, sample_weight=sample_weight, batch_size=batch_size,
            epochs=1, shuffle=False, verbose=verbose,
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


def pretrain(
    data,
    output_dir,
    tokenizer=None,
    vocabulary_size=4000,
    model="mhf",
    architecture="mini_h4b1024",
    extra_layers=0,
    signature_rule="unique",
    sequence_length=128,
    batch_size=8,
    steps=300,
    learning_rate=2e-3,
    warmup_steps=30,
    weight_decay=0.1,
    validation_data=None,
    validation_fraction=0.05,
    validation_blocks=64,
    checkpoint_every=50,
    max_tokens=None,
    mixed_precision=False,
    seed=0,
    distribution=None,
    mesh=None,
    stop_after_chunks=None,
    verbose=1,
):
    """Trains a MultiHashFormer (or the Standard baseline) with `model.fit`.

    Args:
        data: a `.txt`/`.jsonl` file, a directory of them, or a list.
        output_dir: where the tokenizer, checkpoints, `log.csv`, `loss.png`,
            `summary.json` and the final preset (`preset/`) go.
        tokenizer: path to a SentencePiece `.model`; if `None`, one with
            `vocabulary_size` pieces is trained on the training text.
        vocabulary_size: pieces of the tokenizer trained when `tokenizer` is
            `None`.
        model: `"mhf"` or `"standard"`.
        architecture: e.g. `"mini_h4b1024"` (see `architecture_names()`).
        extra_layers: Standard+kL.
        signature_rule: MHF signature rule (`"unique"`, `"reference"`, or
            `"repeated"` for the single-ID ablation).
        sequence_length: tokens per packed training sequence.
        batch_size: sequences per step.
        steps: optimizer steps.
        learning_rate: peak learning rate.
        warmup_steps: linear warmup steps.
        weight_decay: AdamW decay (not applied to norms and biases).
        validation_data: held-out file/directory; if `None`, the last
            `validation_fraction` of the documents is held out.
        validation_fraction: see above.
        validation_blocks: at most this many held-out blocks are scored.
        checkpoint_every: steps per chunk: validation, log line and
            checkpoint after each chunk.
        max_tokens: cap on training tokens read.
        mixed_precision: train under `mixed_bfloat16`.
        seed: seeds the weights and the data order.
        distribution: `None`, `"data"` or `"model"`: train over all devices
            with `keras.distribution` (JAX backend only; other backends are
            refused with a clear error instead of silently using one device).
        mesh: `(batch, model)` sizes or `"2x4"` for the distribution.
        stop_after_chunks: stop (as if killed) after this many chunks of
            this call; for testing resumption.
        verbose: Keras progress bar verbosity.

    Returns:
        dict summary (also written to `summary.json`).
    """
    from keras_mhf.models import MultiHashFormerTokenizer

    if distribution is not None:
        from keras_mhf.distribution import check_batch_size
        from keras_mhf.distribution import make_distribution

        strategy = make_distribution(distribution, mesh)
        check_batch_size(batch_size, strategy)
        keras.distribution.set_distribution(strategy)
    os.makedirs(output_dir, exist_ok=True)
    if mixed_precision:
        keras.config.set_dtype_policy("mixed_bfloat16")
    documents = list(read_documents(data))
    if validation_data is not None:
        train_documents = documents
        validation_documents = list(read_documents(validation_data))
    else:
        held_out = max(1, int(len(documents) * validation_fraction))
        if len(documents) < 2:
            raise ValueError("Need at least two documents to hold one out.")
        train_documents = documents[:-held_out]
        validation_documents = documents[-held_out:]

    if tokenizer is None:
        tokenizer_path = os.path.join(output_dir, "tokenizer.model")
        if not os.path.exists(tokenizer_path):
            train_sentencepiece(train_documents, vocabulary_size, tokenizer_path)
    else:
        tokenizer_path = tokenizer
    tokenizer = MultiHashFormerTokenizer(tokenizer_path)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
    bos = tokenizer.start_token_id
    train_blocks = pack_documents(
        train_documents, sp.encode, bos, sequence_length, max_tokens
    )
    validation_blocks = pack_documents(
        validation_documents, sp.encode, bos, sequence_length
    )[:validation_blocks]

    keras.utils.set_random_seed(seed)
    lm = build_model(model, tokenizer, architecture, sequence_length, extra_layers,
                     signature_rule)
    optimizer = make_optimizer(learning_rate, steps, warmup_steps, weight_decay)
    lm.compile(optimizer=optimizer, loss=lm.loss if model == "standard" else "auto")

    order = data_order(len(train_blocks), steps * batch_size, seed)
    chunks = math.ceil(steps / checkpoint_every)
    checkpoint = os.path.join(output_dir, "checkpoint.weights.h5")
    state_path = os.path.join(output_dir, "checkpoint.json")
    log_path = os.path.join(output_dir, "log.csv")
    start_chunk = 0
    if os.path.exists(state_path) and os.path.exists(checkpoint):
        with open(state_path) as f:
            state = json.load(f)
        if state.get("steps") != steps or state.get("batch_size") != batch_size:
            raise ValueError(
                f"{output_dir} holds a checkpoint of a run with different "
                f"steps/batch_size ({state}); use a new output directory."
            )
        optimizer.build(lm.trainable_variables)
        lm.load_weights(checkpoint)
        start_chunk = state["chunk"]
        if verbose:
            print(f"Resuming from step {state['step']} ({checkpoint}).")
    elif os.path.exists(log_path):
        os.remove(log_path)

    started = time.time()
    fields = ["step", "tokens", "train_loss", "val_loss", "val_perplexity",
              "val_accuracy", "learning_rate", "seconds"]
    for chunk in range(start_chunk, chunks):
        if stop_after_chunks is not None and chunk - start_chunk >= stop_after_chunks:
            break
        first = chunk * checkpoint_every
        last = min(steps, first + checkpoint_every)
        if verbose:
            print(f"Steps {first + 1}-{last} of {steps}")
        history = fit_blocks(
            lm, train_blocks[order[first * batch_size : last * batch_size]],
            batch_size, verbose,
        )
        metrics = perplexity(lm, validation_blocks, batch_size)
        row = {
            "step": last,
            "tokens": last * batch_size * sequence_length,
            "train_loss": history.history["loss"][-1],
            "val_loss": metrics["loss"],
            "val_perplexity": metrics["perplexity"],
            "val_accuracy": metrics["accuracy"],
            "learning_rate": float(keras.ops.convert_to_numpy(
                optimizer.learning_rate)),
            "seconds": round(time.time() - started, 1),
        }
        new_file = not os.path.exists(log_path)
        with open(log_path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            if new_file:
                writer.writeheader()
            writer.writerow(row)
        if verbose:
            print(
                f"step {last}: train loss {row['train_loss']:.3f}, validation "
                f"perplexity {row['val_perplexity']:.2f} (over the real vocabulary)"
            )
        lm.save_weights(checkpoint)
        with open(state_path, "w") as f:
            json.dump({"chunk": chunk + 1, "step": last, "steps": steps,
                       "batch_size": batch_size}, f)

    finished = os.path.exists(state_path) and json.load(open(state_path))["chunk"] >= chunks
    summary = {
        "model": model,
        "architecture": architecture,
        "parameters": int(sum(np.prod(v.shape) for v in lm.trainable_weights)),
        "train_tokens_available": int(train_blocks.size),
        "steps": steps,
        "finished": finished,
        "tokenizer": os.path.abspath(tokenizer_path),
        "log": os.path.abspath(log_path),
    }
    if finished:
        preset = os.path.join(output_dir, "preset")
        lm.save_to_preset(preset)
        summary["preset"] = os.path.abspath(preset)
        summary["validation"] = perplexity(lm, validation_blocks, batch_size)
        plot = plot_log(log_path, os.path.join(output_dir, "loss.png"))
        if plot:
            summary["plot"] = os.path.abspath(plot)
        with open(os.path.join(output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    summary["model_object"] = lm
    return summary


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
    ax.plot(tokens, [float(r["train_loss"]) for r in rows], "o-", label="train loss (model objective)")
    ax.plot(tokens, [float(r["val_loss"]) for r in rows], "s-", label="validation NLL per token")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("nats")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
