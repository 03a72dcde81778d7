"""Refuses KerasHub preset directories whose files disagree with each other.

A preset written by `save_to_preset` describes the model twice: the backbone
in `config.json` and inside `task.json`, the preprocessor in
`preprocessor.json` and inside `task.json`, the tokenizer in `tokenizer.json`
and inside `preprocessor.json`. KerasHub's task loader builds the model from
`task.json` alone, so an edit to `config.json` (say `num_hashes`) would be
ignored without a word, while `Backbone.from_preset` reads `config.json`.
`check_preset_consistency` refuses such a preset, naming the two files and
every field that differs. The MultiHashFormer and Standard classes call it on
every loading route (the task's `from_preset`, the preprocessor's
`load_preset_assets`, the backbones' `load_weights` of a preset's weights).

Example:

```python
check_preset_consistency("runs/mhf/preset")  # ValueError if edited apart
```
"""

import contextlib
import contextvars
import json
import os

# (file, section of it) pairs that must describe the same object.
_PAIRS = (
    (("config.json", ()), ("task.json", ("config", "backbone"))),
    (("preprocessor.json", ()), ("task.json", ("config", "preprocessor"))),
    (
        ("tokenizer.json", ()),
        ("preprocessor.json", ("config", "tokenizer")),
    ),
)
_WEIGHT_FILES = ("model.weights.h5", "model.weights.json")
# Set by `MultiHashFormerCausalLM.from_preset(..., scoring_temperature=T)`:
# the caller chose the task's settings, so a lost task.json is no loss.
_TASK_SETTINGS_GIVEN = contextvars.ContextVar(
    "task_settings_given", default=False
)
_MAX_LISTED = 8


def _section(preset, name, keys):
    path = os.path.join(preset, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"Preset {preset}: cannot read {name} ({error})."
        ) from error
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value if isinstance(value, dict) else None


def _differences(a, b, prefix=""):
    """Dotted paths (with both values) of the fields where `a` and `b`
    differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in list(a) + [k for k in b if k not in a]:
            path = f"{prefix}{key}"
            if key not in a:
                found.append((path, "<missing>", b[key]))
            elif key not in b:
                found.append((path, a[key], "<missing>"))
            else:
                found.extend(_differences(a[key], b[key], path + "."))
        return found
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def _described(serialized):
    """What defines the object: its registered class and its config (the
    module path may move between releases)."""
    return {
        "class": serialized.get("registered_name")
        or serialized.get("class_name"),
        "config": serialized.get("config"),
    }


def check_preset_consistency(preset):
    """Raises a `ValueError` if the files of a local preset directory
    describe different models.

    Args:
        preset: a preset directory (anything else, e.g. a Kaggle handle or a
            Hugging Face checkpoint, is left alone).

    Raises:
        ValueError: naming the two files and the differing fields, e.g.
            `num_hashes: 3 in config.json, 4 in task.json`.

    Example:

    ```python
    check_preset_consistency("runs/mhf/preset")
    ```
    """
    if not isinstance(preset, (str, os.PathLike)):
        return
    preset = os.fspath(preset)
    if not os.path.isdir(preset):
        return
    _check_task_file(preset)
    _check_weights_file(preset)
    for (name_a, keys_a), (name_b, keys_b) in _PAIRS:
        a = _section(preset, name_a, keys_a)
        b = _section(preset, name_b, keys_b)
        if a is None or b is None or "registered_name" not in a:
            continue
        found = _differences(_described(a), _described(b))
        if not found:
            continue
        fields = "; ".join(
            f"{path.removeprefix('config.')}: {va!r} in {name_a}, "
            f"{vb!r} in {name_b}"
            for path, va, vb in found[:_MAX_LISTED]
        )
        if len(found) > _MAX_LISTED:
            fields += f"; and {len(found) - _MAX_LISTED} more"
        raise ValueError(
            f"Preset {preset} disagrees with itself: {name_a} and {name_b} "
            f"describe different models ({fields}). KerasHub's loaders read "
            "one or the other depending on the call, so the model loaded "
            "would not be the one edited. Edit both files the same way, or "
            "re-save the model with `save_to_preset`."
        )


@contextlib.contextmanager
def task_settings_given():
    """Within the block, an MHF task preset without `task.json` loads: the
    caller passed the task's settings (the scoring temperature)
    explicitly."""
    token = _TASK_SETTINGS_GIVEN.set(True)
    try:
        yield
    finally:
        _TASK_SETTINGS_GIVEN.reset(token)


def _check_task_file(preset):
    """Refuses an MHF task preset (one saved with its preprocessor) whose
    `task.json` is gone: KerasHub would build the task with defaults, and
    the calibrated scoring temperature would silently become 1.0."""
    if _TASK_SETTINGS_GIVEN.get() or os.path.exists(
        os.path.join(preset, "task.json")
    ):
        return
    config = _section(preset, "config.json", ())
    if not config or not os.path.exists(
        os.path.join(preset, "preprocessor.json")
    ):
        return  # a backbone preset: it never had task settings
    if "MultiHashFormer" not in str(
        config.get("registered_name") or config.get("class_name")
    ):
        return  # Standard: a task without settings of its own
    raise ValueError(
        f"Preset {preset} has no task.json, though it was saved as a task "
        "(it has preprocessor.json): the task's settings, such as the "
        "calibrated scoring temperature, are lost, and the model would "
        "score with the paper's rule (temperature 1.0) without a word. "
        "Restore task.json (re-save the model with `save_to_preset`), or "
        "load it with a temperature on purpose: "
        "`MultiHashFormerCausalLM.from_preset(preset, "
        "scoring_temperature=1.0)`."
    )


def _check_weights_file(preset):
    """Refuses a model preset (it has `config.json`) whose weights file is
    missing, naming it (KerasHub reports the sharded index it then looks
    for, `model.weights.json`)."""
    if not os.path.exists(os.path.join(preset, "config.json")):
        return  # e.g. a tokenizer preset
    if any(os.path.exists(os.path.join(preset, n)) for n in _WEIGHT_FILES):
        return
    raise ValueError(
        f"Preset {preset} has no model.weights.h5 (nor a sharded "
        "model.weights.json): its weights are missing, so the model cannot "
        "be loaded. Copy the weights file back, or save the model again "
        "with `save_to_preset`."
    )


def check_preset_of_weights(filepath):
    """`check_preset_consistency` on the preset directory holding
    `filepath` when it is a preset's weight file (`model.weights.h5` or the
    sharded `model.weights.json`); other weight files are left alone.

    Example:

    ```python
    check_preset_of_weights("runs/mhf/preset/model.weights.h5")
    ```
    """
    if not isinstance(filepath, (str, os.PathLike)):
        return
    filepath = os.fspath(filepath)
    if os.path.basename(filepath) in _WEIGHT_FILES:
        check_preset_consistency(os.path.dirname(filepath) or ".")
