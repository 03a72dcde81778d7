"""What the `keras-mhf` subcommands share: the help formatter (every
option with its default) and one-line error reporting."""

import argparse
import os
import sys

from keras_mhf.settings.run_settings import settings_of
from keras_mhf.settings.setting import PATHS
from keras_mhf.settings.settings_file import SettingsFileError
from keras_mhf.settings.settings_file import read_settings_file


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


def refuse_existing_output(parser, args):
    """A usage error (exit status 2) when `--output` exists and
    `--overwrite` was not given."""
    if os.path.exists(args.output) and not args.overwrite:
        parser.error(
            f"{args.output} exists; pass --overwrite to replace it or choose "
            "a new --output."
        )


def refuse_output_over_input(
    parser, output, source, output_name="--output", source_name="--preset"
):
    """A usage error (exit status 2), before anything is written, when
    `output` is, contains or lies inside the input `source` (symbolic links
    resolved; `keras_mhf.utils.files.output_overlap_problem`): writing it,
    `--overwrite` above all, would change or destroy the input."""
    from keras_mhf.utils.files import output_overlap_problem

    problem = output_overlap_problem(output, source, output_name, source_name)
    if problem:
        parser.error(problem)


def one_path_or_list(values):
    """`--data a` -> `"a"`, `--data a b` -> `["a", "b"]`."""
    return values[0] if values and len(values) == 1 else values


def add_run_settings(parser, command):
    """`--config FILE` and one flag per setting of `command` (`"pretrain"`
    or `"finetune"`), made from `keras_mhf.settings.RUN_SETTINGS` with
    their help and the command's defaults, in the table's sections."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a TOML (or YAML) file of settings, one `name = value` each, "
        "named as in OUTPUT/config.toml (which every run writes, so that "
        "--config OUTPUT/config.toml reruns it); flags given with it "
        "override its values",
    )
    sections = {}
    for setting in settings_of(command):
        if setting.group not in sections:
            sections[setting.group] = parser.add_argument_group(setting.group)
        setting.add_flag(sections[setting.group], command)


def run_settings_from(parser, args, command):
    """`{name: value}` of the settings given: the `--config` file's, then
    the flags' on top (defaults fill the rest where the run is made). A
    file that cannot be read, or a required setting given nowhere, is a
    usage error (exit status 2)."""
    values = {}
    if args.config is not None:
        try:
            values.update(read_settings_file(args.config, command))
        except SettingsFileError as error:
            parser.error(str(error))
    for setting in settings_of(command):
        if hasattr(args, setting.name):
            value = getattr(args, setting.name)
            if setting.type is PATHS:
                value = one_path_or_list(value)
            values[setting.name] = value
    missing = [
        s.flag
        for s in settings_of(command)
        if s.required and values.get(s.name) in (None, "", [])
    ]
    if missing:
        parser.error(
            "the following arguments are required: "
            + ", ".join(missing)
            + " (as flags, or in the --config file)"
        )
    return values


def run_reporting_errors(parser, run, verbose=1):
    """Calls `run()` (a `pretrain` or `finetune` call) and returns its
    summary; a refused run exits with status 2 (`parser.error`), a failed
    one with status 1 and one line naming the error, never a traceback.
    Unless `verbose` is 0, the first line printed names the backend."""
    import keras

    from keras_mhf.pretraining import CheckpointError
    from keras_mhf.pretraining import DiskFullError
    from keras_mhf.pretraining import NonFiniteTrainingError
    from keras_mhf.pretraining import OutputLockedError
    from keras_mhf.pretraining import RunConfigError

    if verbose:
        print(
            f"{parser.prog}: Keras backend {keras.config.backend()} "
            "(KERAS_BACKEND=jax|tensorflow|torch chooses it; jax by default)",
            flush=True,
        )
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
