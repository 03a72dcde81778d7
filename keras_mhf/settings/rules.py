"""The rules of the settings of a run (no Keras): the value checks that
`keras_mhf.settings.run_settings.RUN_SETTINGS` names, each
`rule(setting, value, values) -> problem(s) or None`, with the allowed
values and the parsers they share with the rest of the package
(`parse_mesh`, `preset_directory`). Messages name the setting by its flag,
as a user gave it.

Example:

>>> from keras_mhf.settings.setting import Setting
>>> steps = Setting("steps", int, 300, "optimizer steps", rule=integer(1))
>>> steps.problems(0, None)
['--steps must be an integer >= 1, got 0']
"""

import argparse
import math
import os

import numpy as np

from keras_mhf.settings.setting import PATHS
from keras_mhf.utils.files import output_overlap_problem

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


def name(setting, value, values):
    """A non-empty string (e.g. a field or column name)."""
    if not isinstance(value, str) or not value:
        return f"{setting.label} must be a non-empty name, got {value!r}"
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
        check = paths if setting.type is PATHS else path
        return check(setting, value, values)

    return rule


def architecture(setting, value, values):
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


def extra_layers(setting, value, values):
    found = integer(0)(setting, value, values)
    if found is None and value and values.initial_preset is not None:
        return "--extra-layers does not apply to a preset"
    if found is None and value and values.model == "mhf":
        return "--extra-layers applies to --model standard (Standard+kL)"
    return found


def optimizer(setting, value, values):
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


def mesh(setting, value, values):
    if value is None:
        return None
    try:
        parse_mesh(value)
    except (ValueError, TypeError) as error:
        return str(error).rstrip(".")
    return None


def directory_or_keyword(setting, value, values):
    """A directory, `"auto"` (a default place in the output) or `"none"`."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        return (
            f"{setting.flag} must be a directory, 'auto' or 'none', "
            f"got {value!r}"
        )
    return None


# The optimizer counts its updates (with gradient accumulation: its
# micro-batches) in an int32 on JAX, where 64-bit integers are off.
MAX_OPTIMIZER_CALLS = 2**31 - 1


def steps(setting, value, values):
    """An integer >= 1 whose optimizer calls (steps x micro-batches) fit
    the optimizer's step counter and the learning-rate schedule."""
    if not (is_int(value) and value >= 1):
        return f"{setting.flag} must be an integer >= 1, got {value!r}"
    parts = values.gradient_accumulation_steps
    parts = parts if is_int(parts) and parts >= 1 else 1
    if value * parts > MAX_OPTIMIZER_CALLS:
        return (
            f"{setting.flag} {value} is more optimizer steps than a run can "
            f"count: steps x micro-batches must be at most "
            f"{MAX_OPTIMIZER_CALLS:,} (the optimizer's step counter)"
        )
    return None


def gradient_accumulation(setting, value, values):
    """An integer >= 1 that divides the global batch (each micro-batch is
    `batch_size / value` windows)."""
    if not (is_int(value) and value >= 1):
        return f"{setting.flag} must be an integer >= 1, got {value!r}"
    batch = values.batch_size
    if is_int(batch) and batch >= 1 and batch % value:
        return (
            f"--batch-size {batch} does not split into {setting.flag} "
            f"{value} equal micro-batches; use a batch size that is a "
            f"multiple of {value}"
        )
    return None


def verbose(setting, value, values):
    if not (is_int(value) and 0 <= value <= 2):
        return f"verbose must be 0, 1 or 2, got {value!r}"
    return None


def lora_rank(setting, value, values):
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


def train_tables(setting, value, values):
    found = true_or_false(setting, value, values)
    if found is None and value and values.lora_rank in (None, 0):
        if values.initial_preset is None:
            return "--train-tables needs a preset to fine-tune (initial_preset)"
        return "--train-tables applies to LoRA (--lora-rank >= 1)"
    return found


def preset(setting, value, values):
    """A directory holding `config.json` (KerasHub's preset or a Hugging
    Face export), apart from the run's output (which would overwrite it);
    `RunConfig` checks what it holds."""
    if value is None:
        return None
    problem = preset_problem(value)
    if problem:
        return f"{setting.flag} {problem}"
    if is_path(values.output_dir):
        problem = output_overlap_problem(
            values.output_dir, value, "--output", setting.flag
        )
        return problem and problem.rstrip(".")
    return None


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
