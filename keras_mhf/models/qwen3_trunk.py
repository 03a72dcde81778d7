"""The Qwen3 decoder stack shared by MultiHashFormer and the Standard baseline.

Paper Sec. 3.2: pre-RMSNorm blocks, GQA attention with RoPE and per-head
RMSNorm on q and k, SwiGLU MLP without biases, a final RMSNorm, full attention.

This is the only module that imports KerasHub's private Qwen3 block
(`keras_hub.src.models.qwen3`), so a KerasHub upgrade touches one file. The
pinned keras-hub 0.32 has two known bugs we work around here: the q/k-norm
epsilon is not forwarded from the block (it stays 1e-5, where HF Qwen3 uses
`rms_norm_eps`), and the block's `get_config` omits `head_dim` and
`sliding_window_size`. Importing this module patches the block's `build` so
the q/k norms get the block's `layer_norm_epsilon` (this also holds for
KerasHub Qwen3 models rebuilt from a preset, so a saved Standard baseline
reloads with the same numbers); and we never serialise a block on its own
(backbones are rebuilt from their constructor arguments).
"""

import keras
from keras import ops
from keras_hub.src.models.qwen3.qwen3_decoder import Qwen3TransformerDecoder
from keras_hub.src.models.qwen3.qwen3_layernorm import Qwen3LayerNorm


def trunk_kernel_initializer():
    return keras.initializers.RandomNormal(stddev=0.02)


def make_decoder_blocks(
    num_layers,
    num_query_heads,
    num_key_value_heads,
    head_dim,
    intermediate_dim,
    rope_max_wavelength,
    rope_scaling_factor,
    layer_norm_epsilon,
    dropout,
    dtype,
):
    """Returns `num_layers` Qwen3 blocks named `transformer_layer_{i}`."""
    return [
        Qwen3TransformerDecoder(
            intermediate_dim=intermediate_dim,
            head_dim=head_dim,
            num_query_heads=num_query_heads,
            num_key_value_heads=num_key_value_heads,
            rope_max_wavelength=rope_max_wavelength,
            rope_scaling_factor=rope_scaling_factor,
            layer_norm_epsilon=layer_norm_epsilon,
            activation=ops.silu,
            kernel_initializer=trunk_kernel_initializer(),
            dropout=dropout,
            sliding_window_size=None,  # full attention, as the paper
            dtype=dtype,
            name=f"transformer_layer_{i}",
        )
        for i in range(num_layers)
    ]


def make_final_norm(layer_norm_epsilon, dtype):
    return Qwen3LayerNorm(
        epsilon=layer_norm_epsilon, dtype=dtype, name="sequence_output_layernorm"
    )


def _set_qk_norm_epsilon(block):
    attention = block._self_attention_layer
    attention._query_dense_layer_norm.epsilon = block.layer_norm_epsilon
    attention._key_dense_layer_norm.epsilon = block.layer_norm_epsilon
    attention.layer_norm_epsilon = block.layer_norm_epsilon


if not getattr(Qwen3TransformerDecoder.build, "_keras_mhf_patched", False):
    _original_build = Qwen3TransformerDecoder.build

    def _build_with_qk_epsilon(self, decoder_sequence_shape):
        _original_build(self, decoder_sequence_shape)
        _set_qk_norm_epsilon(self)

    _build_with_qk_epsilon._keras_mhf_patched = True
    Qwen3TransformerDecoder.build = _build_with_qk_epsilon


def trunk_parameter_count(
    num_layers,
    hidden_dim,
    num_query_heads,
    num_key_value_heads,
    head_dim,
    intermediate_dim,
):
    """Parameters of the decoder stack plus the final norm (no embeddings)."""
    attention = hidden_dim * head_dim * (2 * num_query_heads + 2 * num_key_value_heads)
    qk_norms = 2 * head_dim
    mlp = 3 * hidden_dim * intermediate_dim
    norms = 2 * hidden_dim
    return num_layers * (attention + qk_norms + mlp + norms) + hidden_dim
