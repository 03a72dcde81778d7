"""What the Hugging Face exporters share: refusing quantized models, Keras
variables as safetensors entries, JSON files, the tokenizer files, and the
atomic write of the output directory (a temporary directory next to it,
renamed into place, so a failed export leaves nothing behind and an
existing export is only replaced, with `overwrite=True`, once the new one
is complete)."""

import json
import os
import shutil
import tempfile

import keras
import numpy as np

from keras_mhf.export.transformers import weight_names
from keras_mhf.export.transformers.safetensors_writer import write_safetensors
from keras_mhf.export.transformers.sentencepiece_tokenizer_files import (
    write_tokenizer_files,
)
from keras_mhf.utils.files import fsync_directory
from keras_mhf.utils.files import fsync_file
from keras_mhf.utils.keras_private import flatten_layers

WEIGHTS_FILE = "model.safetensors"

# Backbone class name -> the module whose `export_causal_lm` writes its task
# (as KerasHub's `hf_exporter` keys its exporters by backbone).
CAUSAL_LM_EXPORTERS = {
    "MultiHashFormerBackbone": "export_multi_hash_former",
    "StandardBackbone": "export_qwen3",
}


def check_not_quantized(model):
    """Raises a clear error if any layer of `model` is quantized: the
    Hugging Face checkpoint holds float weights only."""
    quantized = sorted(
        {
            layer.name
            for layer in flatten_layers(model, include_self=True)
            if getattr(layer, "quantization_mode", None) is not None
        }
    )
    if quantized:
        raise ValueError(
            "Cannot export a quantized model to Hugging Face transformers: "
            f"layers {quantized[:5]} are quantized "
            f"({len(quantized)} in all), and the checkpoint format holds "
            "float weights only. Export the model before calling "
            "`quantize()` (e.g. reload its preset)."
        )


def float_dtype(variable):
    dtype = keras.backend.standardize_dtype(variable.dtype)
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(
            f"Variable {variable.path} has dtype {dtype}; only float "
            "weights can be exported."
        )
    return dtype


def _to_numpy(value, dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        array = keras.ops.convert_to_numpy(keras.ops.cast(value, "float32"))
        return array.astype(ml_dtypes.bfloat16)
    return np.asarray(keras.ops.convert_to_numpy(value), dtype=dtype)


def variable_entry(hf_key, variable, layout):
    """A safetensors entry (see `write_safetensors`) for one Keras variable,
    converted to the torch layout only when written. A layer with LoRA
    enabled gives its kernel as a tensor, the adapters merged into it
    (`kernel + (alpha / rank) A B`): that merged kernel is written."""
    dtype = float_dtype(variable)

    def produce():
        value = (
            variable.value if isinstance(variable, keras.Variable) else variable
        )
        return weight_names.to_torch_layout(_to_numpy(value, dtype), layout)

    shape = weight_names.torch_shape(variable.shape, layout)
    return (hf_key, shape, dtype, produce)


def stacked_entry(hf_key, variables):
    """One `[n * rows, cols]` entry from `n` variables `[rows, cols]` (the
    MHF bucket tables), stacked only when written."""
    dtype = float_dtype(variables[0])
    rows, cols = (int(s) for s in variables[0].shape)

    def produce():
        return np.concatenate(
            [_to_numpy(v.value, dtype) for v in variables], axis=0
        )

    return (hf_key, (rows * len(variables), cols), dtype, produce)


def write_weights(directory, entries):
    write_safetensors(
        os.path.join(directory, WEIGHTS_FILE), entries, {"format": "pt"}
    )


def write_json(path, content):
    with open(path, "w") as f:
        json.dump(content, f, indent=2, ensure_ascii=False)
        f.write("\n")


def rope_parameters(backbone):
    """`rope_parameters` of a Keras Qwen3 trunk (KerasHub's scaling factor
    divides positions: HF's "linear" RoPE)."""
    factor = float(backbone.rope_scaling_factor)
    if factor == 1.0:
        return {
            "rope_type": "default",
            "rope_theta": float(backbone.rope_max_wavelength),
        }
    return {
        "rope_type": "linear",
        "rope_theta": float(backbone.rope_max_wavelength),
        "factor": factor,
    }


def qwen3_config(backbone, max_position_embeddings, dtype):
    """The stock Qwen3 fields of `config.json` for a Keras Qwen3 trunk (full
    attention, tied embeddings, no attention biases)."""
    layers = int(backbone.num_layers)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": int(backbone.vocabulary_size),
        "hidden_size": int(backbone.hidden_dim),
        "intermediate_size": int(backbone.intermediate_dim),
        "num_hidden_layers": layers,
        "num_attention_heads": int(backbone.num_query_heads),
        "num_key_value_heads": int(backbone.num_key_value_heads),
        "head_dim": int(backbone.head_dim),
        "hidden_act": "silu",
        "max_position_embeddings": int(max_position_embeddings),
        "initializer_range": 0.02,
        "rms_norm_eps": float(backbone.layer_norm_epsilon),
        "use_cache": True,
        "tie_word_embeddings": True,
        "rope_parameters": rope_parameters(backbone),
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "layer_types": ["full_attention"] * layers,
        "attention_dropout": float(backbone.dropout),
        "dtype": dtype,
    }


def special_token_ids(tokenizer):
    """`(bos, eos)` ids of a tokenizer (`None` without one)."""
    if tokenizer is None:
        return None, None
    return tokenizer.start_token_id, tokenizer.end_token_id


def generation_config(bos, eos, pad):
    config = {"_from_model_config": True}
    for key, value in (
        ("bos_token_id", bos),
        ("eos_token_id", eos),
        ("pad_token_id", pad),
    ):
        if value is not None:
            config[key] = int(value)
    return config


def tokenizer_proto(tokenizer):
    """The SentencePiece model bytes of a `MultiHashFormerTokenizer`."""
    proto = getattr(tokenizer, "proto", None)
    if proto is None:
        raise ValueError(
            "The tokenizer has no SentencePiece model to export (its proto "
            "is not set)."
        )
    if isinstance(proto, str):
        with open(proto, "rb") as f:
            proto = f.read()
    return bytes(proto)


def write_tokenizer(tokenizer, directory, model_max_length=None):
    write_tokenizer_files(
        tokenizer_proto(tokenizer), directory, model_max_length
    )


def write_directory(path, overwrite, write):
    """Creates the directory `path` atomically: `write(staging_dir)` fills
    a temporary directory next to `path`, which then replaces it.

    An existing `path` is refused unless `overwrite`; then it is replaced
    only after the new directory is complete. Returns `path`.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(
            f"{path} already exists; exporting into it would mix old and new "
            "files. Choose a new path or pass overwrite=True."
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path} exists and is not a directory.")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".hf_export_", dir=parent)
    old = None
    try:
        target = os.path.join(staging, "export")
        os.mkdir(target)
        write(target)
        for name in os.listdir(target):
            fsync_file(os.path.join(target, name))
        fsync_directory(target)
        if os.path.exists(path):
            old = os.path.join(staging, "previous")
            os.replace(path, old)
        os.replace(target, path)
        fsync_directory(parent)
    except BaseException:
        if old is not None and not os.path.exists(path):
            os.replace(old, path)  # put the previous export back
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def export_tokenizer(tokenizer, path, overwrite=False):
    """Writes only the tokenizer files (see
    `sentencepiece_tokenizer_files`) to a new directory `path`."""
    return write_directory(
        path, overwrite, lambda d: write_tokenizer(tokenizer, d)
    )


def write_checkpoint(directory, content, entries, pad_token_id, tokenizer):
    """Writes a Hugging Face checkpoint into `directory`: `config.json`
    (`content`), `generation_config.json`, `model.safetensors` (`entries`,
    one tensor at a time) and, with a tokenizer, its files."""
    write_json(f"{directory}/config.json", content)
    write_json(
        f"{directory}/generation_config.json",
        generation_config(
            content["bos_token_id"], content["eos_token_id"], pad_token_id
        ),
    )
    write_weights(directory, entries)
    if tokenizer is not None:
        write_tokenizer(tokenizer, directory)


def export(model, path, overwrite, write):
    """Refuses a quantized `model`, then `write(directory)` into a fresh
    temporary directory renamed to `path` (`write_directory`)."""
    check_not_quantized(model)
    return write_directory(path, overwrite, write)


def export_causal_lm(causal_lm, path, overwrite, max_position_embeddings):
    """`export_to_transformers` of a causal LM task: the exporter of its
    backbone (`CAUSAL_LM_EXPORTERS`) writes `path`."""
    import importlib

    name = type(causal_lm.backbone).__name__
    if name not in CAUSAL_LM_EXPORTERS:
        raise ValueError(
            f"No Hugging Face exporter for a {name}; supported backbones: "
            f"{sorted(CAUSAL_LM_EXPORTERS)}."
        )
    module = importlib.import_module(
        f"keras_mhf.export.transformers.{CAUSAL_LM_EXPORTERS[name]}"
    )
    return module.export_causal_lm(
        causal_lm, path, overwrite, max_position_embeddings
    )
