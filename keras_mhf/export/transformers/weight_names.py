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


def trunk_weights(backbone):
    """Entries of the Qwen3 decoder blocks and the final norm (stock HF
    Qwen3 names, as `keras_hub`'s `convert_qwen3` reads them)."""
    entries = []
    for i in range(backbone.num_layers):
        block = backbone.get_layer(f"transformer_layer_{i}")
        attention = block._self_attention_layer
        p = f"model.layers.{i}."
        entries += [
            (
                p + "input_layernorm.weight",
                block._self_attention_layernorm.scale,
                "copy",
            ),
            (
                p + "self_attn.q_proj.weight",
                attention._query_dense.kernel,
                "einsum_in",
            ),
            (
                p + "self_attn.q_norm.weight",
                attention._query_dense_layer_norm.scale,
                "copy",
            ),
            (
                p + "self_attn.k_proj.weight",
                attention._key_dense.kernel,
                "einsum_in",
            ),
            (
                p + "self_attn.k_norm.weight",
                attention._key_dense_layer_norm.scale,
                "copy",
            ),
            (
                p + "self_attn.v_proj.weight",
                attention._value_dense.kernel,
                "einsum_in",
            ),
            (
                p + "self_attn.o_proj.weight",
                attention._output_dense.kernel,
                "einsum_out",
            ),
            (
                p + "mlp.gate_proj.weight",
                block._feedforward_gate_dense.kernel,
                "linear",
            ),
            (
                p + "mlp.up_proj.weight",
                block._feedforward_intermediate_dense.kernel,
                "linear",
            ),
            (
                p + "mlp.down_proj.weight",
                block._feedforward_output_dense.kernel,
                "linear",
            ),
            (
                p + "post_attention_layernorm.weight",
                block._feedforward_layernorm.scale,
                "copy",
            ),
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
