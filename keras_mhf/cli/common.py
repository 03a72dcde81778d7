"""What the `keras-mhf` subcommands share: the help formatter (every
option with its default) and one-line error reporting."""

import argparse
import os
import sys


class HelpFormatter(
    argparse.ArgumentDefaultsHelpFormatter,
    argparse.RawDescriptionHelpFormatter,
):
    """Shows each option's default (except `None` and `False`, which mean
    "not given") and keeps the description's and epilog's line breaks."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: once its arguments parse, it loads the package
    (Keras, and TensorFlow through KerasHub; `keras_mhf._load`), with the
    start-up lines that mean nothing dropped. `--help` and a bad argument
    answer before that, in well under a second."""

    def parse_known_args(self, args=None, namespace=None):
        parsed = super().parse_known_args(args, namespace)
        import keras_mhf

        keras_mhf._load()
        return parsed


def parser_from_doc(doc, prog=None):
    """A `CommandParser` whose description is the module docstring's first
    paragraph and whose epilog is the rest after the usage examples."""
    parts = doc.split("\n\n", 2)
    return CommandParser(
        prog=prog,
        description=parts[0],
        epilog=parts[2] if len(parts) > 2 else None,
        formatter_class=HelpFormatter,
    )


def preset_directory(path):
    """`--preset`'s type: a directory holding `config.json` (a KerasHub
    preset, e.g. `runs/mhf/preset`, or a Hugging Face export); anything
    else is a usage error (exit status 2) that says what is expected."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        where = "is not a directory"
        if os.path.isdir(path):
            where = "has no config.json"
        raise argparse.ArgumentTypeError(
            f"{path!r} {where}; give a preset directory, e.g. runs/mhf/preset "
            "(written by keras-mhf pretrain or finetune) or a Hugging Face "
            "export"
        )
    return path


def refuse_existing_output(parser, args):
    """A usage error (exit status 2) when `--output` exists and
    `--overwrite` was not given."""
    if os.path.exists(args.output) and not args.overwrite:
        parser.error(
            f"{args.output} exists; pass --overwrite to replace it or choose "
            "a new --output."
        )


def one_path_or_list(values):
    """`--data a` -> `"a"`, `--data a b` -> `["a", "b"]`."""
    return values[0] if values and len(values) == 1 else values


# Options that `pretrain` and `finetune` share, passed through by name.
TRAINING_OPTIONS = (
    "sequence_length",
    "batch_size",
    "steps",
    "learning_rate",
    "warmup_steps",
    "weight_decay",
    "optimizer",
    "validation_fraction",
    "validation_blocks",
    "checkpoint_every",
    "calibrate",
    "workers",
    "on_error",
    "precision",
    "seed",
    "compilation_cache",
    "discard_unusable_checkpoints",
)


def add_training_options(p, defaults):
    """The options `keras-mhf pretrain` and `finetune` share (`--help` shows
    each default). `defaults` gives `steps`, `learning_rate`,
    `warmup_steps`, `weight_decay`, `validation_fraction` and
    `checkpoint_every`, which differ between the two."""
    p.add_argument(
        "--sequence-length", type=int, default=128, help="tokens per window"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="global batch size (all devices and processes together)",
    )
    p.add_argument(
        "--steps", type=int, default=defaults["steps"], help="optimizer steps"
    )
    p.add_argument(
        "--learning-rate",
        type=float,
        default=defaults["learning_rate"],
        help="peak learning rate",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=defaults["warmup_steps"],
        help="linear warmup before the cosine decay",
    )
    p.add_argument(
        "--weight-decay",
        type=float,
        default=defaults["weight_decay"],
        help="AdamW decay (not on norms and biases)",
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "keras_adamw"),
        default="adamw",
        help="adamw: epsilon after bias correction, as torch.optim.AdamW and "
        "the authors' runs; keras_adamw: Keras' AdamW (epsilon before the "
        "correction; runs made before 0.2)",
    )
    _add_validation_and_run_options(p, defaults)


def _add_validation_and_run_options(p, defaults):
    """The validation, calibration, data-check and process options of
    `add_training_options`."""
    p.add_argument(
        "--validation-data",
        nargs="+",
        default=None,
        help="raw text only: held-out files; default: the documents a hash "
        "of their text puts in the --validation-fraction",
    )
    p.add_argument(
        "--validation-fraction",
        type=float,
        default=defaults["validation_fraction"],
        help="raw text only: share of documents held out for validation",
    )
    p.add_argument(
        "--validation-blocks",
        type=int,
        default=64,
        help="held-out windows scored at every checkpoint",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=defaults["checkpoint_every"],
        help="steps between validation, log line and checkpoint",
    )
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="MHF: keep the paper's scoring rule (temperature 1.0) instead of "
        "fitting the scoring temperature on the first half of the validation "
        "windows (the second half is reported either way)"
        # The formatter would print "(default: True)" for calibrate.
        "%(default).0s",
    )
    p.add_argument(
        "--on-error",
        choices=("fail", "skip"),
        default="fail",
        help="raw text only: a bad line (not UTF-8, invalid JSON, no string "
        "'text', a cut-short .gz) stops the run with its file:line (fail) or "
        "is skipped with a warning (skip)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="do not re-hash the prepared corpus's shards against index.json "
        "(and check their token ids) when the run starts or resumes",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="raw text only: tokenizer processes when preparing it; every "
        "core if not given",
    )
    p.add_argument(
        "--precision",
        choices=("float32", "mixed_bfloat16", "bfloat16"),
        default="float32",
        help="float32; mixed_bfloat16 (bf16 compute, float32 weights); "
        "bfloat16 (weights and optimizer state in bf16 too, as the authors "
        "trained); the loss and the cascade's softmax stay float32",
    )
    p.add_argument(
        "--mixed-precision",
        action="store_const",
        dest="precision",
        const="mixed_bfloat16",
        help="the same as --precision mixed_bfloat16 (kept from 0.1)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="initialisation and the order of the data",
    )
    p.add_argument(
        "--compilation-cache",
        default="auto",
        metavar="DIR",
        help="JAX only: a persistent cache of compiled programs, so that a "
        "resumed run starts training within seconds; 'auto' is "
        "OUTPUT/compilation_cache, 'none' turns it off",
    )
    p.add_argument(
        "--discard-unusable-checkpoints",
        action="store_true",
        help="when OUTPUT holds checkpoints and none can be loaded, set them "
        "aside (step_N.unusable) and train from step 0 (without it, such a "
        "run is refused)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars or messages (the summary is still printed)",
    )


def training_settings(args):
    """The keyword settings of `pretrain` / `finetune` that both command
    lines share, from their parsed arguments."""
    settings = {name: getattr(args, name) for name in TRAINING_OPTIONS}
    settings.update(
        validation_data=one_path_or_list(args.validation_data),
        verify_data=not args.no_verify,
        verbose=0 if args.quiet else 1,
    )
    return settings


def run_reporting_errors(parser, run):
    """Calls `run()` (a `pretrain` or `finetune` call) and returns its
    summary; a refused run exits with status 2 (`parser.error`), a failed
    one with status 1 and one line naming the error, never a traceback."""
    from keras_mhf.pretraining import CheckpointError
    from keras_mhf.pretraining import DiskFullError
    from keras_mhf.pretraining import NonFiniteTrainingError
    from keras_mhf.pretraining import OutputLockedError
    from keras_mhf.pretraining import RunConfigError

    try:
        _, summary = run()
    except RunConfigError as error:
        parser.error(str(error))
    except (
        NonFiniteTrainingError,
        CheckpointError,
        DiskFullError,
        OutputLockedError,
    ) as error:
        name = type(error).__name__
        print(f"{parser.prog}: error: {name}: {error}", file=sys.stderr)
        if isinstance(error, DiskFullError):
            # HDF5 keeps the file whose write failed and closes it again at
            # interpreter exit, which crashes the process (exit 139) while
            # the disk is still full: everything is written and flushed, so
            # the process ends here instead.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        sys.exit(1)
    return summary
