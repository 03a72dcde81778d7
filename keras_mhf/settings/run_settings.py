"""Every setting of a pre-training or fine-tuning run, declared once
(`RUN_SETTINGS`, no Keras), and what is derived from the table:
`RunConfig`'s fields and their checks (`keras_mhf.pretraining.config`), the
flags of `keras-mhf pretrain` and `finetune` with their help and defaults
(`keras_mhf.cli.common.add_run_settings`), settings files
(`keras_mhf.settings.settings_file`), the settings a resumed run must match
(`OUTPUT/run.json`) and the docs' table (`settings_table`).

Adding a setting is one entry here; the code that acts on it reads it from
the `RunConfig`.

Example:

>>> [s.name for s in settings_of("finetune")][:3]
['data', 'output_dir', 'initial_preset']
>>> command_defaults("finetune")["steps"], command_defaults("pretrain")["steps"]
(100, 300)
"""

import argparse
import math
import os

import numpy as np

from keras_mhf.settings.setting import COMMANDS
from keras_mhf.settings.setting import PATHS
from keras_mhf.settings.setting import SAME
from keras_mhf.settings.setting import Setting

MODELS = ("mhf", "standard")
SIGNATURE_RULES = ("unique", "reference", "repeated")
DISTRIBUTIONS = (None, "data", "model", "fsdp")
# `keras_mhf.pretraining.training.make_optimizer`'s names.
OPTIMIZERS = ("adamw", "keras_adamw")
# Keras dtype policies a run trains in: float32; mixed_bfloat16 (float32
# weights and optimizer state, bf16 compute); bfloat16 (weights and AdamW
# state in bf16 too, as the authors trained). The loss and the cascade's
# softmax are float32 under every policy.
PRECISIONS = ("float32", "mixed_bfloat16", "bfloat16")
ON_ERROR = ("fail", "skip")


def is_int(value):
    """An integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_finite_number(value):
    """An int or float (not a bool) that is neither NaN nor infinite."""
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def is_path(value):
    return isinstance(value, (str, os.PathLike)) and bool(os.fspath(value))


def parse_mesh(mesh):
    """`"2x4"` or `(2, 4)` -> `(2, 4)`, the (batch, model) sizes of a device
    mesh.

    Example:

    >>> parse_mesh("2x4")
    (2, 4)
    """
    if isinstance(mesh, str):
        try:
            mesh = tuple(int(p) for p in mesh.lower().split("x"))
        except ValueError as error:
            raise ValueError(
                f"--mesh must look like 2x4; got {mesh!r}."
            ) from error
    mesh = tuple(mesh)
    if len(mesh) != 2 or not all(is_int(m) and m >= 1 for m in mesh):
        raise ValueError(f"The mesh must be (batch, model) sizes; got {mesh}.")
    return mesh


# --- Rules: rule(setting, value, values) -> problem(s) or None -------------


def integer(minimum, optional=False):
    """An integer >= `minimum` (or `None`, if `optional`)."""

    def rule(setting, value, values):
        if optional and value is None:
            return None
        if not (is_int(value) and value >= minimum):
            return (
                f"{setting.label} must be an integer >= {minimum}, "
                f"got {value!r}"
            )
        return None

    return rule


def number(above=None, at_least=None):
    """A finite number > `above` or >= `at_least`."""

    def rule(setting, value, values):
        bound = f"> {above}" if above is not None else f">= {at_least}"
        ok = is_finite_number(value) and (
            value > above if above is not None else value >= at_least
        )
        if not ok:
            return (
                f"{setting.label} must be a finite number {bound}, "
                f"got {value!r}"
            )
        return None

    return rule


def fraction(setting, value, values):
    if not (is_finite_number(value) and 0 < value < 1):
        return (
            f"{setting.label} must be between 0 and 1 (exclusive), "
            f"got {value!r}"
        )
    return None


def spelled(choices):
    """`'a', 'b' or 'c'`."""
    names = [repr(c) for c in choices if c is not None]
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " or " + names[-1]


def one_of(setting, value, values):
    if value not in setting.choices:
        left_out = " (or left out)" if None in setting.choices else ""
        return (
            f"{setting.label} must be {spelled(setting.choices)}{left_out}, "
            f"got {value!r}"
        )
    return None


def true_or_false(setting, value, values):
    if not isinstance(value, (bool, np.bool_)):
        return f"{setting.label} must be True or False, got {value!r}"
    return None


def path(setting, value, values):
    """`None` or a path."""
    if value is not None and not is_path(value):
        return f"{setting.label} must be a path, got {value!r}"
    return None


def paths(setting, value, values):
    """`None`, a path, or a non-empty list of paths."""
    if isinstance(value, (list, tuple)):
        if value and all(is_path(v) for v in value):
            return None
    elif value is None or is_path(value):
        return None
    return f"{setting.label} must be a path or a list of paths, got {value!r}"


def required(what):
    def rule(setting, value, values):
        if value is None or (
            isinstance(value, (str, list, tuple)) and not value
        ):
            return f"{setting.flag} is required{what}"
        check = path if setting.type is str else paths
        return check(setting, value, values)

    return rule


def _architecture(setting, value, values):
    """A name that parses, with a hash part for an MHF model (a preset
    decides its own architecture)."""
    if values.initial_preset is not None:
        return None
    from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (  # noqa: E501
        parse_architecture,
    )

    try:
        _, hashes = parse_architecture(value)
    except (ValueError, TypeError, AttributeError) as error:
        return str(error).rstrip(".")
    if values.model == "mhf" and hashes is None:
        return (
            f"--architecture {value} has no hash part; an MHF model "
            "needs '<trunk>_h<H>b<B>' (e.g. tiny_h3b512)"
        )
    return None


def _extra_layers(setting, value, values):
    found = integer(0)(setting, value, values)
    if found is None and value and values.initial_preset is not None:
        return "--extra-layers does not apply to a preset"
    if found is None and value and values.model == "mhf":
        return "--extra-layers applies to --model standard (Standard+kL)"
    return found


def _optimizer(setting, value, values):
    found = one_of(setting, value, values)
    if found is None and value == "keras_adamw":
        if values.precision == "bfloat16":
            # Keras' AdamW computes 1 - beta_2**t in the weights' dtype: in
            # bf16, 0.999 is 1.0 and no weight would ever change.
            return (
                "optimizer 'keras_adamw' cannot train bfloat16 weights (it "
                "computes its bias correction in bf16, where beta_2 = 0.999 "
                "rounds to 1.0, so no weight changes); use --optimizer "
                "adamw or --precision mixed_bfloat16"
            )
    return found


def _mesh(setting, value, values):
    if value is None:
        return None
    try:
        parse_mesh(value)
    except (ValueError, TypeError) as error:
        return str(error).rstrip(".")
    return None


def _compilation_cache(setting, value, values):
    if value is not None and not isinstance(value, (str, os.PathLike)):
        return (
            f"{setting.flag} must be a directory, 'auto' or 'none', "
            f"got {value!r}"
        )
    return None


def _verbose(setting, value, values):
    if not (is_int(value) and 0 <= value <= 2):
        return f"verbose must be 0, 1 or 2, got {value!r}"
    return None


def _lora_rank(setting, value, values):
    if value is None:
        return None
    if not (is_int(value) and value >= 0):
        return (
            f"{setting.flag} must be an integer >= 1 (or 0: every weight "
            f"trains), got {value!r}"
        )
    if values.initial_preset is None:
        return "--lora-rank needs a preset to fine-tune (initial_preset)"
    return None


def _train_tables(setting, value, values):
    found = true_or_false(setting, value, values)
    if found is None and value and values.lora_rank in (None, 0):
        if values.initial_preset is None:
            return "--train-tables needs a preset to fine-tune (initial_preset)"
        return "--train-tables applies to LoRA (--lora-rank >= 1)"
    return found


def _preset(setting, value, values):
    """A directory holding `config.json` (KerasHub's preset or a Hugging
    Face export); `RunConfig` checks what it holds."""
    if value is None:
        return None
    problem = preset_problem(value)
    return problem and f"{setting.flag} {problem}"


def preset_problem(path):
    """What is wrong with `path` as a preset directory (`None` if
    nothing): it must hold `config.json`."""
    if not is_path(path):
        return f"must be a preset directory, got {path!r}"
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    where = (
        "has no config.json" if os.path.isdir(path) else "is not a directory"
    )
    return (
        f"{os.fspath(path)!r} {where}; give a preset directory, e.g. "
        "runs/mhf/preset (written by keras-mhf pretrain or finetune) or a "
        "Hugging Face export"
    )


def preset_directory(path):
    """`--preset`'s `argparse` type: a directory holding `config.json`;
    anything else is a usage error that says what is expected."""
    problem = preset_problem(path)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


PRETRAIN = ("pretrain",)
FINETUNE = ("finetune",)
DATA = "data and model"
VALIDATION = "validation and calibration"
RUN = "the run"
SCALING = "scaling out"
HOSTS = "multi-host (JAX): the same arguments in every process but --process-id"

RUN_SETTINGS = (
    Setting(
        "data",
        PATHS,
        None,
        "a prepared corpus directory (index.json, from `keras-mhf "
        "prepare`), or raw text: .txt/.jsonl/.jsonl.gz files, directories "
        "or glob patterns, prepared into OUTPUT/data first (for finetune, "
        "with the preset's tokenizer)",
        rule=required(": a prepared directory or text"),
        required=True,
        group=DATA,
    ),
    Setting(
        "output_dir",
        str,
        None,
        "output directory (reused to resume)",
        flag="--output",
        rule=required(""),
        required=True,
        group=DATA,
    ),
    Setting(
        "initial_preset",
        str,
        None,
        "the MHF or Standard preset to fine-tune (e.g. runs/mhf/preset); it "
        "decides the model and the tokenizer",
        commands=FINETUNE,
        flag="--preset",
        rule=_preset,
        parse=preset_directory,
        required=True,
        recorded="fingerprint",
        group=DATA,
    ),
    Setting(
        "tokenizer",
        str,
        None,
        "SentencePiece .model; default: for raw text, train one on a "
        "sample of it; for a prepared directory, the one its index.json "
        "records",
        commands=PRETRAIN,
        rule=path,
        group=DATA,
    ),
    Setting(
        "vocabulary_size",
        int,
        4000,
        "pieces of the tokenizer trained when --tokenizer is not given",
        commands=PRETRAIN,
        rule=integer(1),
        group=DATA,
    ),
    Setting(
        "model",
        str,
        "mhf",
        "MultiHashFormer or the Standard baseline (KerasHub Qwen3)",
        commands=PRETRAIN,
        choices=MODELS,
        rule=one_of,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "architecture",
        str,
        "mini_h4b1024",
        "e.g. tiny_h3b512, mini_h4b1024, 100m_h4b16k (trunk only for standard)",
        commands=PRETRAIN,
        rule=_architecture,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "extra_layers",
        int,
        0,
        "Standard+kL: k more decoder layers",
        commands=PRETRAIN,
        rule=_extra_layers,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "signature_rule",
        str,
        "unique",
        "MHF signatures: unique (no two tokens share one), reference (the "
        "authors' rule, bit for bit) or repeated (the single-ID ablation)",
        commands=PRETRAIN,
        choices=SIGNATURE_RULES,
        rule=one_of,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "lora_rank",
        int,
        None,
        "rank of the LoRA adapters on the attention query and value "
        "projections; 0 trains every weight",
        finetune_default=8,
        commands=FINETUNE,
        rule=_lora_rank,
        none_spelling=0,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "train_tables",
        bool,
        False,
        "also train the hash tables (MHF) / token embedding (Standard), "
        "e.g. after expand-vocabulary",
        commands=FINETUNE,
        rule=_train_tables,
        recorded="value",
        group=DATA,
    ),
    Setting(
        "sequence_length",
        int,
        128,
        "tokens per window",
        rule=integer(1),
        recorded="value",
    ),
    Setting(
        "batch_size",
        int,
        8,
        "global batch size (all devices and processes together)",
        rule=integer(1),
        recorded="value",
    ),
    Setting(
        "steps",
        int,
        300,
        "optimizer steps",
        finetune_default=100,
        rule=integer(1),
        recorded="value",
    ),
    Setting(
        "learning_rate",
        float,
        2e-3,
        "peak learning rate",
        finetune_default=1e-3,
        rule=number(above=0),
    ),
    Setting(
        "warmup_steps",
        int,
        30,
        "linear warmup before the cosine decay",
        finetune_default=10,
        rule=integer(0),
    ),
    Setting(
        "weight_decay",
        float,
        0.1,
        "AdamW decay (not on norms and biases)",
        finetune_default=0.0,
        rule=number(at_least=0),
    ),
    Setting(
        "optimizer",
        str,
        "adamw",
        "adamw: epsilon after bias correction, as torch.optim.AdamW and the "
        "authors' runs; keras_adamw: Keras' AdamW (epsilon before the "
        "correction; runs made before 0.2)",
        choices=OPTIMIZERS,
        rule=_optimizer,
    ),
    Setting(
        "precision",
        str,
        "float32",
        "float32; mixed_bfloat16 (bf16 compute, float32 weights); bfloat16 "
        "(weights and optimizer state in bf16 too, as the authors trained); "
        "the loss and the cascade's softmax stay float32",
        choices=PRECISIONS,
        rule=one_of,
        aliases={"--mixed-precision": "mixed_bfloat16"},
        recorded="value",
    ),
    Setting(
        "mixed_precision",
        bool,
        False,
        "kept from 0.1: True is precision mixed_bfloat16",
        flag="",
        rule=true_or_false,
        written=False,
    ),
    Setting(
        "seed",
        int,
        0,
        "initialisation and the order of the data",
        rule=integer(0),
        recorded="value",
    ),
    Setting(
        "validation_data",
        PATHS,
        None,
        "raw text only: held-out files; default: the documents a hash of "
        "their text puts in the --validation-fraction",
        rule=paths,
        group=VALIDATION,
    ),
    Setting(
        "validation_fraction",
        float,
        0.05,
        "raw text only: share of documents held out for validation",
        finetune_default=0.1,
        rule=fraction,
        group=VALIDATION,
    ),
    Setting(
        "validation_blocks",
        int,
        64,
        "held-out windows scored at every checkpoint",
        rule=integer(1),
        group=VALIDATION,
    ),
    Setting(
        "calibrate",
        bool,
        True,
        "MHF: fit the scoring temperature on the first half of the "
        "validation windows at the end (--no-calibrate keeps the paper's "
        "rule, temperature 1.0); the second half is reported either way",
        rule=true_or_false,
        group=VALIDATION,
    ),
    Setting(
        "checkpoint_every",
        int,
        50,
        "steps between validation, log line and checkpoint",
        finetune_default=25,
        rule=integer(1),
        group=RUN,
    ),
    Setting(
        "workers",
        int,
        None,
        "raw text only: tokenizer processes when preparing it; every core "
        "if not given",
        rule=integer(1, optional=True),
        group=RUN,
    ),
    Setting(
        "on_error",
        str,
        "fail",
        "raw text only: a bad line (not UTF-8, invalid JSON, no string "
        "'text', a cut-short .gz) stops the run with its file:line (fail) "
        "or is skipped with a warning (skip)",
        choices=ON_ERROR,
        rule=one_of,
        group=RUN,
    ),
    Setting(
        "verify_data",
        bool,
        True,
        "re-hash the prepared corpus's shards against index.json (and check "
        "their token ids) when the run starts or resumes",
        flag="--verify",
        rule=true_or_false,
        group=RUN,
    ),
    Setting(
        "compilation_cache",
        str,
        "auto",
        "JAX only: a persistent cache of compiled programs, so that a "
        "resumed run starts training within seconds; 'auto' is "
        "OUTPUT/compilation_cache, 'none' turns it off",
        metavar="DIR",
        rule=_compilation_cache,
        none_spelling="none",
        group=RUN,
    ),
    Setting(
        "discard_unusable_checkpoints",
        bool,
        False,
        "when OUTPUT holds checkpoints and none can be loaded, set them "
        "aside (step_N.unusable) and train from step 0 (otherwise such a "
        "run is refused)",
        rule=true_or_false,
        group=RUN,
    ),
    Setting(
        "verbose",
        int,
        1,
        "no progress bars or messages (the summary is still printed)",
        flag="",
        aliases={"--quiet": 0},
        rule=_verbose,
        group=RUN,
    ),
    Setting(
        "rematerialize",
        bool,
        False,
        "recompute each decoder block in the backward pass (gradient "
        "checkpointing): larger batches in the same memory, the same "
        "numbers; on JAX's CPU backend start with XLA_FLAGS="
        "--xla_cpu_enable_concurrency_optimized_scheduler=false",
        commands=PRETRAIN,
        rule=true_or_false,
        group=SCALING,
    ),
    Setting(
        "distribution",
        str,
        None,
        "train over all devices (JAX backend only): data parallel, model "
        "parallel, or fully sharded data parallel (weights and optimizer "
        "state split along the batch axis, across hosts too)",
        commands=PRETRAIN,
        choices=DISTRIBUTIONS,
        rule=one_of,
        group=SCALING,
    ),
    Setting(
        "mesh",
        str,
        None,
        "(batch)x(model) device mesh, e.g. 2x4 (required for --distribution "
        "model)",
        commands=PRETRAIN,
        rule=_mesh,
        group=SCALING,
    ),
    Setting(
        "coordinator",
        str,
        None,
        "address of process 0, which every process connects to",
        commands=PRETRAIN,
        metavar="HOST:PORT",
        group=HOSTS,
        written=False,
        run_config=False,
    ),
    Setting(
        "num_processes",
        int,
        None,
        "processes in all",
        commands=PRETRAIN,
        metavar="N",
        group=HOSTS,
        written=False,
        run_config=False,
    ),
    Setting(
        "process_id",
        int,
        None,
        "this process, 0..N-1",
        commands=PRETRAIN,
        metavar="I",
        group=HOSTS,
        written=False,
        run_config=False,
    ),
)

BY_NAME = {s.name: s for s in RUN_SETTINGS}


def settings_of(command):
    """The settings `command` (`"pretrain"` or `"finetune"`) takes, in the
    table's order."""
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {COMMANDS}, got {command!r}")
    return [s for s in RUN_SETTINGS if command in s.commands]


def command_defaults(command):
    """`{name: default}` of `command`'s settings."""
    return {s.name: s.default_for(command) for s in settings_of(command)}


def finetune_defaults():
    """The defaults in which fine-tuning differs from pre-training."""
    return {
        s.name: s.finetune_default
        for s in RUN_SETTINGS
        if s.finetune_default is not SAME
    }


def part_of_run(setting, command):
    """Whether a run of `command` has `setting`: every run has the
    pre-training settings (a fine-tuning run's model and architecture come
    from its preset); the fine-tuning ones belong to fine-tuning runs."""
    return "pretrain" in setting.commands or command in setting.commands


def setting_problems(values):
    """The problems of every `RunConfig` setting of `values`, in the
    table's order."""
    problems = []
    for setting in RUN_SETTINGS:
        if setting.run_config:
            value = getattr(values, setting.name)
            problems += setting.problems(value, values)
    return problems


def settings_table(command):
    """The settings of `command` as a Markdown table (the docs' reference:
    key in a settings file, flag, default, whether a resumed run must match
    it, what it is)."""
    lines = [
        "| setting (file key) | flag | default | resume | what |",
        "|---|---|---|---|---|",
    ]
    for s in settings_of(command):
        flags = [s.flag] if s.flag else []
        if s.type is bool and s.flag:
            flags.append("--no-" + s.flag[2:])
        flags += list(s.aliases)
        shown = s.shown_default(command)
        resume = {"value": "must match", "fingerprint": "same files"}
        lines.append(
            f"| `{s.name}` | {', '.join(f'`{f}`' for f in flags) or '-'} | "
            f"{'' if shown is None else f'`{shown}`'} | "
            f"{resume.get(s.recorded, '')} | {s.help} |"
        )
    return "\n".join(lines) + "\n"
