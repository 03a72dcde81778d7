"""`log.csv` and `loss.png` of a pre-training run.

`log.csv` gets one row per chunk of `checkpoint_every` steps (`LOG_FIELDS`);
a resumed run first drops the rows of steps it will run again (`trim_log`).

Columns:

- `step` (global optimizer step), `tokens` (training tokens seen so far);
- `train_loss`: the model's objective (for MHF the sum over heads of the
  bucket cross-entropies, not comparable with a Standard model's loss);
- `val_loss`, `val_perplexity`, `val_accuracy`: all validation windows, over
  the real vocabulary, under the paper's rule (the scoring temperature is 1.0
  during training);
- `val_perplexity_reported`: the same rule on the reported windows only (the
  second half, `keras_mhf.pretraining.validation.split_validation_windows`),
  for every model: the Standard number to compare with MHF's calibrated one;
- `val_perplexity_calibrated`, `scoring_temperature` (MHF; empty for
  Standard): a temperature fitted on the first half of the windows and the
  perplexity it gives on the reported half, as the final validation
  computes them (`validate_final_model`); the model is not changed (its
  temperature stays 1.0 during training), so a `calibrate=False` run logs
  the same numbers;
- `learning_rate` and `seconds`.
"""

import csv
import io
import math
import os
import time

import keras
import numpy as np

from keras_mhf.evaluation import paper_rule
from keras_mhf.evaluation import perplexity_details
from keras_mhf.evaluation.calibration import MIN_TOKENS
from keras_mhf.evaluation.calibration import fit_temperature
from keras_mhf.evaluation.calibration import held_out_blocks
from keras_mhf.evaluation.calibration import metrics_at
from keras_mhf.evaluation.calibration import raw_scores
from keras_mhf.evaluation.calibration import token_metrics_at
from keras_mhf.pretraining.config import is_primary
from keras_mhf.pretraining.errors import RunConfigError
from keras_mhf.pretraining.validation import CALIBRATION_MAX_TOKENS
from keras_mhf.pretraining.validation import split_validation_windows
from keras_mhf.utils.files import write_atomically

LOG_FIELDS = [
    "step",
    "tokens",
    "train_loss",
    "val_loss",
    "val_perplexity",
    "val_accuracy",
    "learning_rate",
    "seconds",
    "val_perplexity_reported",
    "val_perplexity_calibrated",
    "scoring_temperature",
]


def score_validation(config, lm, blocks):
    """Scores every validation window once under the paper's rule and, for
    an MHF run, calibrates on the same pass without changing `lm`.

    An MHF run whose fit half (the first half of the windows,
    `split_validation_windows`) holds at least
    `keras_mhf.evaluation.calibration.MIN_TOKENS` predicted tokens scores
    raw token scores (`keras_mhf.evaluation.calibration.raw_scores`) of the
    fit windows up to `CALIBRATION_MAX_TOKENS` and of the reported windows:
    the temperature is fitted on the first (`fit_temperature`), its
    metrics are taken on the second (`metrics_at`), as the final
    calibration does (`validate_final_model`), and the paper's rule is the
    same scores at temperature 1. Fit windows past that many tokens, and
    every window of other runs, go through the compiled scorer
    (`keras_mhf.evaluation.perplexity_details`).

    Returns:
        `(nll, hits, calibrated)`: per-token NLL and top-1 hits of the
        windows in order, flat, under the paper's rule; `calibrated` is
        `(temperature, metrics on the reported half)`, or `None` for
        Standard runs and fit halves below `MIN_TOKENS`.

    Example:

    ```python
    nll, hits, calibrated = score_validation(config, lm, blocks)
    ```
    """
    blocks = np.asarray(blocks)
    per_window = blocks.shape[1] - 1
    (fit_start, fit_end), (start, end) = split_validation_windows(len(blocks))

    def scored(windows):
        _, nll, hits = perplexity_details(
            lm, windows, config.batch_size, progress=False
        )
        return nll.reshape(-1), hits.reshape(-1)

    if config.model != "mhf" or (fit_end - fit_start) * per_window < MIN_TOKENS:
        return (*scored(blocks), None)
    fit = held_out_blocks(
        lm, blocks[fit_start:fit_end], max_tokens=CALIBRATION_MAX_TOKENS
    )
    scores, targets = raw_scores(
        lm,
        np.concatenate([fit, blocks[start:end]]),
        config.batch_size,
        progress=False,
    )
    fitted = fit.shape[0] * per_window
    tau = fit_temperature(scores[:fitted], targets[:fitted])
    calibrated = (tau, metrics_at(scores[fitted:], targets[fitted:], tau))
    nll, _, hits = token_metrics_at(scores, targets, 1.0)
    parts = [(nll[:fitted], hits[:fitted])]
    if fit_start + len(fit) < fit_end:  # fit windows past the cap
        parts.append(scored(blocks[fit_start + len(fit) : fit_end]))
    parts.append((nll[fitted:], hits[fitted:]))
    return (
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        calibrated,
    )


def write_log_row(config, lm, data, history, step, started):
    """Step "log": scores the validation windows once (`score_validation`:
    perplexity over the real vocabulary under the paper's rule, scoring
    temperature 1.0, and an MHF model's temperature fitted on their first
    half, nothing of the model changed) and appends a row to `log.csv` (see
    the module docstring); returns the row.

    Example:

    ```python
    row = write_log_row(config, lm, data, history, 150, time.time())
    ```
    """
    blocks = np.asarray(data.validation_blocks)
    with paper_rule(lm):  # the temperature is 1.0 in training anyway
        nll, hits, calibrated = score_validation(config, lm, blocks)
    _, (start, end) = split_validation_windows(len(blocks))
    per_window = blocks.shape[1] - 1
    row = {
        "step": step,
        "tokens": step * config.batch_size * config.sequence_length,
        "train_loss": history.history["loss"][-1],
        "val_loss": float(nll.mean()),
        "val_perplexity": float(np.exp(float(nll.mean()))),
        "val_accuracy": float(hits.mean()),
        "learning_rate": float(
            keras.ops.convert_to_numpy(lm.optimizer.learning_rate)
        ),
        "seconds": round(time.time() - started, 1),
        "val_perplexity_reported": float(
            np.exp(nll[start * per_window : end * per_window].mean())
        ),
        "val_perplexity_calibrated": "",
        "scoring_temperature": "",
    }
    if calibrated is not None:
        row["scoring_temperature"] = calibrated[0]
        row["val_perplexity_calibrated"] = calibrated[1]["perplexity"]
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
        print(describe_row(config, row, (start, end)))
    return row


def describe_row(config, row, reported):
    """The line a run prints after each chunk: the training objective and
    the validation perplexity over the real vocabulary on the reported
    windows, calibrated for MHF (with the paper's rule beside it), so that
    MHF and Standard runs print numbers that compare.

    Example:

    ```python
    print(describe_row(config, row, (20, 40)))
    ```
    """
    start, end = reported
    where = f"validation windows {start}..{end - 1}"
    if config.model != "mhf":
        return (
            f"step {row['step']}: train loss {row['train_loss']:.3f}, "
            f"{where}: perplexity {row['val_perplexity_reported']:.2f}"
        )
    head = (
        f"step {row['step']}: train loss {row['train_loss']:.3f} (sum over "
        "heads)"
    )
    if row["val_perplexity_calibrated"] == "":
        return (
            f"{head}, {where}: perplexity "
            f"{row['val_perplexity_reported']:,.2f} under the paper's rule "
            "(not calibrated)"
        )
    return (
        f"{head}, {where}: perplexity {row['val_perplexity_calibrated']:.2f} "
        f"calibrated (scoring temperature {row['scoring_temperature']:.3g} "
        f"fitted on windows 0..{start - 1}), "
        f"{row['val_perplexity_reported']:,.2f} under the paper's rule"
    )


def trim_log(config, step):
    """Keeps the rows of `log.csv` up to `step` (a run killed after its log
    line and before its checkpoint logged steps it will run again)."""
    log_path = config.path("log.csv")
    if not os.path.exists(log_path) or not is_primary():
        return
    rows = []
    with open(log_path, newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            logged = _logged_step(row)
            if logged is None:
                raise RunConfigError(
                    f"{log_path}:{reader.line_num}: not a log.csv row (its "
                    f"step is {row.get('step')!r}), so the rows after step "
                    f"{step}, which this resumed run writes again, cannot "
                    "be told apart. Delete or fix that line (or delete "
                    "log.csv: the checkpoints keep the run, only the "
                    "logged curve is lost) and rerun the same command."
                )
            if logged <= step:
                rows.append(row)
    text = io.StringIO()
    writer = csv.DictWriter(
        text, fieldnames=LOG_FIELDS, lineterminator="\n", extrasaction="ignore"
    )
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(log_path, text.getvalue().encode("utf-8"))


def _logged_step(row):
    """A `log.csv` row's step, or `None` when it is not a whole number."""
    try:
        value = float(row.get("step"))
    except (TypeError, ValueError):
        return None
    return int(value) if math.isfinite(value) and value == int(value) else None


def read_log(log_path):
    """The rows of a `log.csv` as dicts of floats (`None` for an empty
    cell: a column a Standard run leaves empty, or one that an older log
    lacks); `[]` when the file does not exist.

    Example:

    ```python
    rows = read_log("runs/mhf/log.csv")
    [r["val_perplexity_calibrated"] for r in rows]
    ```
    """
    if not os.path.exists(log_path):
        return []
    with open(log_path, newline="") as f:
        rows = list(csv.DictReader(f))

    def number(value):
        return float(value) if value not in (None, "") else None

    return [
        {name: number(row.get(name)) for name in LOG_FIELDS} for row in rows
    ]


def comparable_perplexity(row):
    """A row's validation perplexity that compares across models: MHF's
    calibrated one, or the reported windows' under the model's one rule
    (`val_perplexity` for logs written before that column existed)."""
    for name in (
        "val_perplexity_calibrated",
        "val_perplexity_reported",
        "val_perplexity",
    ):
        if row.get(name) is not None and math.isfinite(row[name]):
            return row[name]
    return None


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_log(log_path, png_path):
    """A run's curves against training tokens, as a PNG (needs
    matplotlib): the training objective on its own axis (for MHF the sum
    over heads, which no Standard number compares with), and validation
    perplexity over the real vocabulary on a log axis: MHF calibrated and
    under the paper's rule, Standard under its one rule (reported windows).

    Example:

    ```python
    plot_log("runs/mhf/log.csv", "runs/mhf/loss.png")
    ```
    """
    plt = _pyplot()
    rows = read_log(log_path)
    if plt is None or not rows:
        return None
    tokens = [r["tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(tokens, [r["train_loss"] for r in rows], "o-")
    left.set_title("training objective (MHF: sum over heads)")
    left.set_xlabel("training tokens")
    left.set_ylabel("nats")
    curves = [
        ("val_perplexity_calibrated", "calibrated (reported windows)", "s-"),
        ("val_perplexity_reported", "one rule / paper's rule (reported)", "o-"),
    ]
    if all(r["val_perplexity_reported"] is None for r in rows):
        curves = [("val_perplexity", "paper's rule (all windows)", "o-")]
    for name, label, style in curves:
        values = [r[name] for r in rows]
        if any(v is not None for v in values):
            right.plot(tokens, values, style, label=label)
    right.set_yscale("log")
    right.set_title("validation perplexity (real vocabulary)")
    right.set_xlabel("training tokens")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def plot_comparison(logs, png_path):
    """Validation perplexity of several runs against training tokens on one
    log axis, as a PNG (needs matplotlib): each run's `comparable_perplexity`
    (MHF calibrated, Standard under its one rule, both on the reported
    windows, so runs on the same validation windows compare).

    Args:
        logs: `{label: path to log.csv}`.
        png_path: the PNG to write.

    Returns:
        `png_path`, or `None` without matplotlib or rows.

    Example:

    ```python
    plot_comparison(
        {"mhf": "runs/mhf/log.csv", "standard": "runs/std/log.csv"},
        "runs/comparison.png",
    )
    ```
    """
    plt = _pyplot()
    runs = {label: read_log(path) for label, path in logs.items()}
    if plt is None or not any(runs.values()):
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in runs.items():
        ax.plot(
            [r["tokens"] for r in rows],
            [comparable_perplexity(r) for r in rows],
            "o-",
            label=label,
        )
    ax.set_yscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation perplexity (real vocabulary)")
    ax.set_title("MHF calibrated vs Standard, same windows")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
