"""`finetune`: LoRA (or full) fine-tuning of an MHF or Standard preset, the
engine behind `keras-mhf finetune`.

It is `pretrain` started from a preset (`initial_preset`, see
`keras_mhf.pretraining.presets`), with fine-tuning defaults, so a
fine-tuning run has everything a pre-training run has: raw text prepared
once into `OUTPUT/data/` with the preset's tokenizer (held-out documents for
validation), windows drawn from `(seed, step)`, atomic checkpoints that a
rerun resumes to the bit (for LoRA: the frozen base kernels, the adapters
in `model.lora.h5` and the optimizer state), the lock, `run.json`,
`summary.json` on every exit, and the final calibration. The summary's
`before` holds the preset's scores on the same validation windows
(calibrated on the same half), `validation` the fine-tuned model's.

Outputs besides pretrain's: `before.json` and, for LoRA without trainable
tables, `adapter.lora.h5` (the adapters alone: load them onto the preset
with `backbone.load_lora_weights`). `preset/` is the fine-tuned model with
the adapters merged, loadable without LoRA.
"""

import os

from keras_mhf.pretraining.config import is_primary
from keras_mhf.pretraining.run import pretrain
from keras_mhf.settings.run_settings import finetune_defaults
from keras_mhf.utils.files import write_json

# The defaults in which fine-tuning differs from pre-training (the table
# `keras_mhf.settings.RUN_SETTINGS` declares them): fewer, gentler steps
# from a trained model, LoRA of rank 8.
FINETUNE_DEFAULTS = finetune_defaults()

ADAPTER_FILE = "adapter.lora.h5"


def finetune(preset, data, output_dir, callbacks=None, **settings):
    """Fine-tunes the model of `preset` on `data` with LoRA of rank
    `lora_rank` (default 8; `None` or 0: every weight trains).

    Args:
        preset: a KerasHub preset directory of an MHF or Standard model
            (e.g. a pre-training run's `preset/`); it decides the model and
            the tokenizer.
        data: raw text (`.txt`, `.jsonl`, `.jsonl.gz`, directories, globs)
            or a corpus prepared with the preset's tokenizer.
        output_dir: checkpoints, logs, `summary.json`, `before.json`,
            `preset/` (merged) and `adapter.lora.h5`.
        callbacks: Keras callbacks for training, as `pretrain`'s.
        **settings: the fields of `RunConfig` (the settings of
            `keras-mhf finetune --help`): `lora_rank` (adapters' rank >= 1,
            or `None`/0 for full fine-tuning), `train_tables` (also train
            the hash tables (MHF) or the token embedding (Standard), e.g.
            after `expand_vocabulary`), `steps`, `learning_rate`,
            `batch_size`, ...; unset ones take `FINETUNE_DEFAULTS`, then
            `RunConfig`'s.

    Returns:
        `(lm, summary)` as `pretrain` returns them, the summary with
        `before`, `initial_preset`, `lora_rank`, `train_tables` and, when
        written, `adapter`.

    Raises:
        RunConfigError: as `pretrain`, and for a preset that is not an MHF
            or Standard preset, a quantized preset, a rank < 1, or an
            `output_dir` that is, contains or lies inside `preset`.

    Example:

    ```python
    lm, summary = finetune("runs/mhf/preset", "notes.jsonl", "runs/ft",
                           lora_rank=4, steps=50)
    summary["before"]["validation"]["perplexity"]  # the preset's
    summary["validation"]["perplexity"]  # after fine-tuning
    ```
    """
    settings = {**FINETUNE_DEFAULTS, **settings}
    lm, summary = pretrain(
        data, output_dir, callbacks, initial_preset=preset, **settings
    )
    adapters_alone = summary.get("lora_rank") and not summary["train_tables"]
    if summary.get("finished") and adapters_alone:
        if is_primary():
            path = os.path.join(output_dir, ADAPTER_FILE)
            temporary = os.path.join(
                output_dir, f".tmp-{os.getpid()}-{ADAPTER_FILE}"
            )
            lm.backbone.save_lora_weights(temporary)
            os.replace(temporary, path)
            summary["adapter"] = os.path.abspath(path)
            write_json(
                os.path.join(output_dir, "summary.json"), summary, indent=2
            )
    return lm, summary
