"""`keras-mhf`: MultiHashFormer from the command line.

    keras-mhf quickstart                 # train, generate, evaluate, export
    keras-mhf COMMAND --help             # every option, with its default

Errors are one line saying what to change (exit status 2 for bad arguments,
1 for a failed run); set KERAS_MHF_TRACEBACK=1 to see the traceback of an
unexpected error.
"""

import importlib
import logging
import os
import sys

# name: (module under keras_mhf.cli, one line of help)
COMMANDS = {
    "prepare": ("prepare", "tokenize text corpora once into token shards"),
    "pretrain": ("pretrain", "pre-train an MHF or Standard model"),
    "finetune": ("finetune", "fine-tune a preset, with LoRA or fully"),
    "evaluate": (
        "evaluate",
        "perplexity, the paper's ten tasks and Card-660 of a preset",
    ),
    "expand-vocabulary": (
        "expand_vocabulary",
        "add tokens to a preset (no new parameters for MHF)",
    ),
    "export": ("export", "a preset as a TF SavedModel or Hugging Face folder"),
    "inspect": (
        "inspect",
        "parameters, weight bytes and signature collisions",
    ),
    "generate": (
        "generate",
        "generate text from a preset, streamed as it is made",
    ),
    "serve": (
        "serve",
        "serve a preset with the OpenAI completions API (lm-eval, openai)",
    ),
    "quickstart": (
        "quickstart",
        "train, generate, evaluate and export a small model",
    ),
}


def usage():
    width = max(map(len, COMMANDS))
    lines = [
        "usage: keras-mhf COMMAND [options]",
        "",
        __doc__.split("\n\n")[0],
        "",
        "commands:",
    ]
    lines += [
        f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()
    ]
    lines += ["", __doc__.split("\n\n", 1)[1].strip("\n")]
    return "\n".join(lines) + "\n"


def main(argv=None):
    """Runs `keras-mhf COMMAND ...`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from keras_mhf import __version__

        print(f"keras-mhf {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        sys.stderr.write(
            f"keras-mhf: error: unknown command {name!r}; choose one of "
            f"{', '.join(COMMANDS)} (keras-mhf --help lists them).\n"
        )
        return 2
    if os.environ.get("KERAS_MHF_TRACEBACK") != "1":
        # Libraries' own error logs (Orbax's through absl, with tracebacks
        # from its writer threads) would bury the one line below.
        logging.getLogger("absl").setLevel(logging.CRITICAL)
    module = importlib.import_module(f"keras_mhf.cli.{COMMANDS[name][0]}")
    prog = f"keras-mhf {name}"
    try:
        result = module.main(argv[1:], prog=prog)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    except Exception as error:  # one line, not a traceback
        if os.environ.get("KERAS_MHF_TRACEBACK") == "1":
            raise
        message = str(error).strip().splitlines()
        sys.stderr.write(
            f"{prog}: error: {type(error).__name__}: "
            f"{message[0] if message else ''}\n"
        )
        return 1
    return result if isinstance(result, int) else 0


def console_main():
    """The `keras-mhf` console script."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
