"""`load_causal_lm`: the one loader of the command line (`evaluate`,
`inspect`, `export`, `expand-vocabulary`) and the evaluation for whatever
`--preset` names: a KerasHub preset of a MultiHashFormer or Standard model,
a Hugging Face folder that `export --format transformers` wrote (MHF in
the authors' format, Standard as a stock `Qwen3ForCausalLM`), or (from
Python) a `.keras` file, whose archive is checked when Keras cannot read it.

`keras_hub.models.CausalLM.from_preset` reads neither Hugging Face export
(KerasHub has no converter for `multi_hash_former`, and its Qwen3 converter
looks for Qwen's own special tokens), and it casts a `bfloat16` preset to
Keras' current policy (float32). The classes' own `from_preset` do both
right, so this picks the class from the folder and calls its
`from_preset`; presets of other KerasHub models go to KerasHub's loader.

Example:

```python
lm = load_causal_lm("runs/mhf/preset")  # or runs/mhf/hf, an HF export
lm = load_causal_lm("model.keras")  # a cut-short file is named as damaged
```
"""

import json
import os

# A KerasHub preset's backbone class (`config.json`'s "class_name") -> the
# task class of this package that loads it.
_TASKS = {
    "MultiHashFormerBackbone": "MultiHashFormerCausalLM",
    "StandardBackbone": "StandardCausalLM",
}


def _backbone_class_name(preset):
    try:
        with open(
            os.path.join(str(preset), "config.json"), encoding="utf-8"
        ) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # the loader says what is wrong with the file
    return config.get("class_name") if isinstance(config, dict) else None


def keras_file_problem(path):
    """What is wrong with a `.keras` file as a complete one (`None` if
    nothing): a `.keras` file is a zip archive, and one cut short (a save
    that was killed, a partial copy) or damaged is not, or fails its
    checksums (Keras' own loader calls it "File not found")."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as error:
        return f"it is not a complete .keras (zip) file ({error})"
    if bad is not None:
        return f"its part {bad!r} fails its checksum"
    return None


def load_causal_lm(preset, **kwargs):
    """The causal LM of `preset` (`kwargs` go to its `from_preset`), in the
    precision it was saved in; `preset` may also be a `.keras` file
    (`lm.save("m.keras")`): one that fails to load because it is cut short
    or damaged is named as such.

    Raises:
        ValueError: a Hugging Face folder that cannot be read as either
            export (what to do is in the message), a damaged `.keras`
            file, or the loaders' errors.
    """
    import keras_hub

    if os.fspath(preset).endswith(".keras") and os.path.isfile(preset):
        import keras

        try:
            return keras.saving.load_model(preset, **kwargs)
        except Exception as error:
            # Only a failed load reads the archive again, to say why.
            problem = keras_file_problem(preset)
            if problem is None:
                raise
            raise ValueError(
                f"{os.fspath(preset)} is damaged or cut short: {problem}. "
                "Save the model again (lm.save), or load its preset."
            ) from error

    from keras_mhf.export.transformers import convert_multi_hash_former
    from keras_mhf.export.transformers import convert_qwen3
    from keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm import (
        MultiHashFormerCausalLM,
    )
    from keras_mhf.models.standard.standard_causal_lm import StandardCausalLM

    if convert_multi_hash_former.is_authors_checkpoint(preset):
        kwargs = _saved_export_precision(preset, kwargs)
        return MultiHashFormerCausalLM.from_preset(preset, **kwargs)
    if convert_qwen3.is_qwen3_checkpoint(preset):
        kwargs = _saved_export_precision(preset, kwargs)
        return _load_standard_export(StandardCausalLM, preset, **kwargs)
    name = _TASKS.get(_backbone_class_name(preset))
    if name == "MultiHashFormerCausalLM":
        return MultiHashFormerCausalLM.from_preset(preset, **kwargs)
    if name == "StandardCausalLM":
        return StandardCausalLM.from_preset(preset, **kwargs)
    return keras_hub.models.CausalLM.from_preset(preset, **kwargs)


def _saved_export_precision(preset, kwargs):
    """`kwargs` with the `dtype` a Hugging Face export names in its
    `config.json` (`dtype`, or `torch_dtype` of older transformers), unless
    the caller (or a global Keras policy) chose one: a `bfloat16` export is
    inspected, evaluated and exported again in `bfloat16`."""
    import keras

    chosen = keras.config.dtype_policy().name != "float32"
    if kwargs.get("dtype") is not None or chosen:
        return kwargs
    from keras_mhf.export.transformers import convert_multi_hash_former

    config, _ = convert_multi_hash_former.checkpoint_config(preset)
    if not isinstance(config, dict):
        return kwargs
    saved = config.get("dtype") or config.get("torch_dtype")
    if saved in ("float16", "bfloat16", "float32"):
        return dict(kwargs, dtype=saved)
    return kwargs


def _load_standard_export(cls, preset, **kwargs):
    """A stock `Qwen3ForCausalLM` folder as the Standard baseline; one that
    does not fit it (another model's Qwen3 checkpoint) is refused saying
    what to do."""
    try:
        return cls.from_preset(preset, **kwargs)
    except (ValueError, KeyError) as error:
        raise ValueError(
            f"{preset} is a Hugging Face Qwen3 checkpoint that does not load "
            f"as the Standard baseline ({error}); give the Standard run's "
            "KerasHub preset (its OUTPUT/preset), or load this folder with "
            "transformers.AutoModelForCausalLM."
        ) from error
