"""Hugging Face names of every Keras weight of the Qwen3 trunk and of the
MultiHashFormer interface: one home for the checkpoint layout of the authors' code,
used by the importer (`keras_mhf.export.transformers.convert_multi_hash_former`) and by the
exporters in this package.

Each entry is `(hf_key, keras_variable, layout)`; `layout` says how the
Keras array maps to the torch one:

- `"copy"`: same array (norm scales, biases);
- `"linear"`: a `Dense` kernel `[in, out]` -> torch `Linear` `[out, in]`;
- `"einsum_in"`: an attention input projection `[d, heads, head_dim]` ->
  `[heads * head_dim, d]`;
- `"einsum_out"`: the attention output projection `[heads, head_dim, d]` ->
  `[d, heads * head_dim]`.
"""

import numpy as np

from keras_mhf.utils.keras_private import qwen3_block_sublayers

HASH_MAP = "model.hash_map"
EMBED_TOKENS = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


def encoder_denses(encoder):
    """`(Dense layer, HF prefix)` of the hash encoder's gated combiner."""
    return [
        (encoder.gate_dense, "model.combiner.scorer.0"),
        (encoder.score_dense, "model.combiner.scorer.2"),
        (encoder.output_dense, "model.combiner.output_proj.0"),
    ]


def mixer_denses(decoder):
    """`(Dense layer, HF prefix)` of the cascade mixers, K = 0..H-2."""
    pairs = []
    for k, (down, up) in enumerate(zip(decoder.down_denses, decoder.up_denses)):
        pairs.append((down, f"hash_head.cascade_mixer.{k}.0"))
        pairs.append((up, f"hash_head.cascade_mixer.{k}.2"))
    return pairs


def dense_weights(pairs):
    """Entries for `Dense` layers with biases."""
    entries = []
    for dense, prefix in pairs:
        entries.append((f"{prefix}.weight", dense.kernel, "linear"))
        entries.append((f"{prefix}.bias", dense.bias, "copy"))
    return entries


# (HF weight name under model.layers.N., sublayer, its weight, conversion).
_BLOCK_WEIGHTS = (
    ("input_layernorm.weight", "input_layernorm", "scale", "copy"),
    ("self_attn.q_proj.weight", "q_proj", "kernel", "einsum_in"),
    ("self_attn.q_norm.weight", "q_norm", "scale", "copy"),
    ("self_attn.k_proj.weight", "k_proj", "kernel", "einsum_in"),
    ("self_attn.k_norm.weight", "k_norm", "scale", "copy"),
    ("self_attn.v_proj.weight", "v_proj", "kernel", "einsum_in"),
    ("self_attn.o_proj.weight", "o_proj", "kernel", "einsum_out"),
    ("mlp.gate_proj.weight", "gate_proj", "kernel", "linear"),
    ("mlp.up_proj.weight", "up_proj", "kernel", "linear"),
    ("mlp.down_proj.weight", "down_proj", "kernel", "linear"),
    (
        "post_attention_layernorm.weight",
        "post_attention_layernorm",
        "scale",
        "copy",
    ),
)


def trunk_weights(backbone):
    """Entries of the Qwen3 decoder blocks and the final norm (stock HF
    Qwen3 names, as `keras_hub`'s `convert_qwen3` reads them)."""
    entries = []
    for i in range(backbone.num_layers):
        block = backbone.get_layer(f"transformer_layer_{i}")
        layers = qwen3_block_sublayers(block)
        p = f"model.layers.{i}."
        entries += [
            (p + name, getattr(layers[key], attribute), conversion)
            for name, key, attribute, conversion in _BLOCK_WEIGHTS
        ]
    entries.append(
        (
            FINAL_NORM,
            backbone.get_layer("sequence_output_layernorm").scale,
            "copy",
        )
    )
    return entries


def to_torch_layout(array, layout):
    """A Keras array in the torch layout named by `layout`."""
    if layout == "copy":
        return array
    if layout == "linear":
        return np.ascontiguousarray(np.transpose(array))
    if layout == "einsum_in":
        return np.ascontiguousarray(
            np.transpose(np.reshape(array, (array.shape[0], -1)))
        )
    if layout == "einsum_out":
        return np.ascontiguousarray(
            np.transpose(np.reshape(array, (-1, array.shape[-1])))
        )
    raise ValueError(f"Unknown weight layout {layout!r}.")


def torch_shape(shape, layout):
    """The torch shape of a Keras variable of `shape` (see
    `to_torch_layout`)."""
    shape = tuple(int(s) for s in shape)
    if layout == "copy":
        return shape
    if layout == "linear":
        return shape[::-1]
    if layout == "einsum_in":
        return (int(np.prod(shape[1:])), shape[0])
    if layout == "einsum_out":
        return (shape[-1], int(np.prod(shape[:-1])))
    raise ValueError(f"Unknown weight layout {layout!r}.")
