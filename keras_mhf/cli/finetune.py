"""Fine-tune an MHF (or Standard) preset with LoRA, with `model.fit`.

    keras-mhf finetune --preset runs/mhf/preset \\
        --data notes.jsonl --output runs/ft --lora-rank 8 --steps 100

--preset is a KerasHub preset of a MultiHashFormer or Standard model (e.g.
a pre-training run's OUTPUT/preset); it decides the model and the tokenizer.
--data is raw text (.txt paragraphs or lines, .jsonl {"text": ...},
.jsonl.gz, directories and glob patterns) prepared once into OUTPUT/data with
the preset's tokenizer (--validation-fraction of the documents, chosen by a
hash of their text, or --validation-data, held out), or a corpus prepared
with that tokenizer by `keras-mhf prepare`.

With --lora-rank R only rank-R adapters on the attention query and value
projections train (and the hash tables with --train-tables, e.g. after
expand_vocabulary); --lora-rank 0 trains every weight. The run is
`keras-mhf pretrain`'s engine started from the preset: windows drawn from
(seed, step), validation, a log.csv line and an atomic checkpoint every
--checkpoint-every steps (frozen base kernels, adapters and optimizer
state), exact resume by rerunning the same command, summary.json on every
exit. Before the first step and at the end, an MHF model is calibrated on
the first half of the validation windows and scored on the second half
(summary.json: before and validation; --no-calibrate keeps the paper's
rule). Settings can also come from a TOML (or YAML) file, one `name = value` per
setting, named as in `--help`'s sections and OUTPUT/config.toml (e.g.
learning_rate = 1e-3): `--config FILE`, with flags overriding it. Every run
writes its resolved settings to OUTPUT/config.toml, so that
`keras-mhf finetune --config OUTPUT/config.toml` reruns (or resumes) it.

Outputs: OUTPUT/preset (adapters merged: a plain model),
OUTPUT/adapter.lora.h5 (the adapters alone, for backbone.load_lora_weights
on --preset; LoRA without --train-tables), before.json, log.csv, loss.png,
summary.json.
"""

import json

from keras_mhf.cli.common import add_run_settings
from keras_mhf.cli.common import parser_from_doc
from keras_mhf.cli.common import run_reporting_errors
from keras_mhf.cli.common import run_settings_from


def build_parser(prog=None):
    p = parser_from_doc(__doc__, prog)
    add_run_settings(p, "finetune")
    return p


def main(argv=None, prog=None):
    parser = build_parser(prog)
    settings = run_settings_from(parser, parser.parse_args(argv), "finetune")
    from keras_mhf.pretraining import finetune

    summary = run_reporting_errors(
        parser,
        lambda: finetune(
            settings.pop("initial_preset"),
            settings.pop("data"),
            settings.pop("output_dir"),
            **settings,
        ),
        settings.get("verbose", 1),
    )
    print(json.dumps(summary, indent=2))
    if summary.get("before") and summary.get("validation"):
        print(_before_after(summary))
    return summary


def _before_after(summary):
    """One line: held-out perplexity of the preset and of the fine-tuned
    model, calibrated (MHF) and under the paper's rule."""
    before, after = summary["before"], summary
    line = (
        f"Held-out perplexity before -> after fine-tuning: "
        f"{before['validation']['perplexity']:.2f} -> "
        f"{after['validation']['perplexity']:.2f}"
    )
    if after.get("scoring_temperature") is not None:
        line += (
            f" (calibrated, temperatures {before['scoring_temperature']:.3g}"
            f" -> {after['scoring_temperature']:.3g}); paper's rule "
            f"{before['validation_paper_rule']['perplexity']:.2f} -> "
            f"{after['validation_paper_rule']['perplexity']:.2f}"
        )
    return line + "."


if __name__ == "__main__":
    main()
