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
rule). Outputs: OUTPUT/preset (adapters merged: a plain model),
OUTPUT/adapter.lora.h5 (the adapters alone, for backbone.load_lora_weights
on --preset; LoRA without --train-tables), before.json, log.csv, loss.png,
summary.json.
"""

import json

from keras_mhf.cli.common import add_training_options
from keras_mhf.cli.common import one_path_or_list
from keras_mhf.cli.common import parser_from_doc
from keras_mhf.cli.common import preset_directory
from keras_mhf.cli.common import run_reporting_errors
from keras_mhf.cli.common import training_settings
from keras_mhf.utils.training_defaults import FINETUNE_DEFAULTS


def build_parser(prog=None):
    p = parser_from_doc(__doc__, prog)
    p.add_argument(
        "--preset",
        required=True,
        type=preset_directory,
        help="MHF or Standard preset",
    )
    p.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="raw text files, directories or globs, or a prepared corpus",
    )
    p.add_argument(
        "--output", required=True, help="output directory (reused to resume)"
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=8,
        help="rank of the adapters (>= 1); 0 trains every weight",
    )
    p.add_argument(
        "--train-tables",
        action="store_true",
        help="also train the hash tables (MHF) / token embedding (Standard)",
    )
    add_training_options(p, FINETUNE_DEFAULTS)
    return p


def main(argv=None, prog=None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.lora_rank < 0:
        parser.error(f"--lora-rank must be >= 1 (or 0), got {args.lora_rank}.")
    if args.train_tables and args.lora_rank == 0:
        parser.error("--train-tables applies to LoRA (--lora-rank >= 1).")
    from keras_mhf.pretraining import finetune

    summary = run_reporting_errors(
        parser,
        lambda: finetune(
            args.preset,
            one_path_or_list(args.data),
            args.output,
            lora_rank=args.lora_rank or None,
            train_tables=args.train_tables,
            **training_settings(args),
        ),
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
