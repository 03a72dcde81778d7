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


def parser_from_doc(doc, prog=None):
    """An `ArgumentParser` whose description is the module docstring's first
    paragraph and whose epilog is the rest after the usage examples."""
    parts = doc.split("\n\n", 2)
    return argparse.ArgumentParser(
        prog=prog,
        description=parts[0],
        epilog=parts[2] if len(parts) > 2 else None,
        formatter_class=HelpFormatter,
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
    "validation_fraction",
    "validation_blocks",
    "checkpoint_every",
    "calibrate",
    "workers",
    "mixed_precision",
    "seed",
    "compilation_cache",
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
