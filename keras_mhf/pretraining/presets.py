"""Runs that start from a preset (fine-tuning): `pretrain(...,
initial_preset=P, lora_rank=R, train_tables=...)`, which
`keras_mhf.pretraining.finetune` and `keras-mhf finetune` call.

The preset decides the model (MHF or Standard, its architecture and its
tokenizer: `P/assets/tokenizer/vocabulary.spm`, which raw text is prepared
with); its sha256 (every file of the preset) is one of the run's settings,
so a checkpoint resumes only on the preset it started from. With a LoRA
rank only the adapters train (and, with `train_tables`, the hash tables;
see `keras_mhf.models.lora`). Before the first step, the preset's model is
calibrated and scored on the run's validation windows exactly as the final
model is (`keras_mhf.pretraining.validation.validate_initial_model`), and the
result is kept in `OUTPUT/before.json` for the summary's `before`.

Example:

```python
lm, summary = pretrain(
    "notes.jsonl", "runs/ft", initial_preset="runs/mhf/preset", lora_rank=4
)
summary["before"]["validation"]["perplexity"], summary["validation"]
```
"""

import functools
import hashlib
import json
import os

from keras_mhf.pretraining.errors import RunConfigError

PRESET_TOKENIZER = os.path.join("assets", "tokenizer", "vocabulary.spm")
_KINDS = {"MultiHashFormerBackbone": "mhf", "StandardBackbone": "standard"}


def _read_json(preset, name):
    path = os.path.join(preset, name)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as error:
        raise RunConfigError(
            f"--preset {preset} is not a KerasHub preset directory (no "
            f"{name}); pass the preset/ directory a run wrote."
        ) from error
    except (OSError, ValueError) as error:
        raise RunConfigError(f"{path} is unreadable ({error}).") from error


def preset_kind(preset):
    """`"mhf"` or `"standard"`: the model family of a preset directory.

    Raises:
        RunConfigError: not a preset directory, or a preset of another
            model (only MultiHashFormer and Standard presets are
            fine-tuned).

    Example:

    ```python
    preset_kind("runs/mhf/preset")  # "mhf"
    ```
    """
    if not isinstance(preset, (str, os.PathLike)) or not os.path.isdir(preset):
        raise RunConfigError(f"--preset {preset} is not a directory.")
    config = _read_json(preset, "config.json")
    name = config.get("class_name") if isinstance(config, dict) else None
    dtype = json.dumps(config.get("config", {}).get("dtype"))
    if "Quantized" in dtype:
        raise RunConfigError(
            f"--preset {preset} holds a quantized model; LoRA cannot be "
            "enabled on a quantized model: fine-tune the float preset, then "
            "quantize the result"
        )
    if name not in _KINDS:
        raise RunConfigError(
            f"--preset {preset} holds a {name or 'unknown'} model; only "
            "MultiHashFormer (MultiHashFormerBackbone) and Standard "
            "(StandardBackbone) presets written by keras_mhf can be "
            "fine-tuned here."
        )
    return _KINDS[name]


def preset_backbone_config(preset):
    """The backbone arguments stored in a preset's `config.json`."""
    return dict(_read_json(preset, "config.json")["config"])


def preset_tokenizer(preset):
    """The SentencePiece file of a preset (`assets/tokenizer/vocabulary.spm`).

    Raises:
        RunConfigError: the preset has no tokenizer file.
    """
    path = os.path.join(preset, PRESET_TOKENIZER)
    if not os.path.isfile(path):
        raise RunConfigError(
            f"--preset {preset} has no tokenizer ({PRESET_TOKENIZER}); a "
            "fine-tuning run prepares its text with the preset's tokenizer."
        )
    return path


def preset_fingerprint(preset):
    """sha256 of every file of a preset (names and contents), cached while
    the files keep their sizes and modification times.

    Example:

    ```python
    preset_fingerprint("runs/mhf/preset")[:12]
    ```
    """
    files = []
    for root, _, names in os.walk(preset):
        for name in names:
            path = os.path.join(root, name)
            stat = os.stat(path)
            files.append(
                (os.path.relpath(path, preset), stat.st_size, stat.st_mtime_ns)
            )
    return _fingerprint(os.path.abspath(preset), tuple(sorted(files)))


@functools.lru_cache(maxsize=8)
def _fingerprint(root, files):
    from keras_mhf.utils.files import file_sha256

    digest = hashlib.sha256()
    for name, _, _ in files:
        digest.update(name.encode("utf-8") + b"\0")
        digest.update(file_sha256(os.path.join(root, name)).encode() + b"\0")
    return digest.hexdigest()


def load_initial_model(config, lora=True):
    """The run's model read from `config.initial_preset`, with LoRA of rank
    `config.lora_rank` (unless `lora=False`, or the rank is `None`: every
    weight trains) and `config.train_tables`.

    Raises:
        RunConfigError: the preset does not load, or LoRA cannot be enabled
            on it (a quantized preset).

    Example:

    ```python
    lm = load_initial_model(config)  # then compiled by build_run_model
    ```
    """
    from keras_mhf.models.lora import enable_lora
    from keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm import (
        MultiHashFormerCausalLM,
    )
    from keras_mhf.models.standard.standard_causal_lm import StandardCausalLM

    kind = preset_kind(config.initial_preset)
    cls = MultiHashFormerCausalLM if kind == "mhf" else StandardCausalLM
    try:
        lm = cls.from_preset(config.initial_preset)
    except (ValueError, TypeError, OSError) as error:
        raise RunConfigError(
            f"--preset {config.initial_preset} does not load: {error}"
        ) from error
    preprocessor = getattr(lm, "preprocessor", None)
    if preprocessor is not None:
        preprocessor.sequence_length = config.sequence_length
    if lora and config.lora_rank is not None:
        try:
            enable_lora(lm, config.lora_rank, train_tables=config.train_tables)
        except ValueError as error:
            raise RunConfigError(
                f"--preset {config.initial_preset}: {error}"
            ) from error
    return lm
