"""`log.csv` and `loss.png` of a pre-training run.

`log.csv` gets one row per chunk of `checkpoint_every` steps (`LOG_FIELDS`);
a resumed run first drops the rows of steps it will run again (`trim_log`).

Columns: `step` (global optimizer step), `tokens` (training tokens seen so
far), `train_loss` (the model's objective: for MHF the sum over heads of the
bucket cross-entropies), `val_loss`, `val_perplexity` and `val_accuracy` (all
validation windows, over the real vocabulary, under the paper's rule: the
scoring temperature is 1.0 during training; the calibrated numbers of the
final model are in `summary.json`), `learning_rate` and `seconds`.
"""

import csv
import io
import os
import time

import keras

from keras_mhf.evaluation import paper_rule
from keras_mhf.evaluation import perplexity
from keras_mhf.pretraining.config import is_primary
from keras_mhf.pretraining.files import write_atomically

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


def write_log_row(config, lm, data, history, step, started):
    """Step "log": scores the validation windows (perplexity over the real
    vocabulary, `keras_mhf.evaluation.perplexity`, under the paper's rule:
    scoring temperature 1.0) and appends a row to `log.csv` (`step`,
    `tokens`: training tokens seen so far, losses, learning rate, seconds;
    see the module docstring); returns the row.

    Example:

    ```python
    row = write_log_row(config, lm, data, history, 150, time.time())
    ```
    """
    with paper_rule(lm):  # the temperature is 1.0 in training anyway
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
    if is_primary():
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


def trim_log(config, step):
    """Keeps the rows of `log.csv` up to `step` (a run killed after its log
    line and before its checkpoint logged steps it will run again)."""
    log_path = config.path("log.csv")
    if not os.path.exists(log_path) or not is_primary():
        return
    with open(log_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if int(r["step"]) <= step]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=LOG_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(log_path, text.getvalue().encode("utf-8"))


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
