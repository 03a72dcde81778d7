"""The Qwen3 decoder block shared by MultiHashFormer and the Standard baseline.

This is the only module of `keras_mhf` that imports KerasHub's private Qwen3
code (`keras_hub.src.models.qwen3`), so a KerasHub upgrade touches one file.
keras-hub is pinned to the tested minor version (0.32) because of that.

KerasHub 0.32 workarounds, all in `Qwen3DecoderBlock` and nowhere else (the
stock classes are never modified, so KerasHub's own Qwen3 models in the same
process behave exactly as without `keras_mhf`):

- the q/k RMSNorms of `Qwen3TransformerDecoder` ignore the block's
  `layer_norm_epsilon` (they stay at 1e-5; Hugging Face Qwen3 uses
  `rms_norm_eps` everywhere): `build` sets them to the block's epsilon;
- `Qwen3TransformerDecoder.get_config` omits `head_dim` and
  `sliding_window_size`, so the stock block cannot be rebuilt from its
  config: `get_config` adds them.
"""

import keras
from keras_hub.src.models.qwen3.qwen3_decoder import Qwen3TransformerDecoder
from keras_hub.src.models.qwen3.qwen3_layernorm import Qwen3LayerNorm


@keras.saving.register_keras_serializable(package="keras_mhf")
class Qwen3DecoderBlock(Qwen3TransformerDecoder):
    """KerasHub's Qwen3 decoder block with every RMSNorm on one epsilon.

    Paper Sec. 3.2: a pre-RMSNorm block with GQA attention, RoPE and per-head
    RMSNorm on q and k, and a SwiGLU MLP without biases. Identical to
    `Qwen3TransformerDecoder` (same weights, same initialisation order, same
    KV cache) except that the q/k norms use `layer_norm_epsilon` and that
    `get_config` round-trips (see the module docstring).

    Args:
        intermediate_dim: int, SwiGLU width.
        num_query_heads: int.
        num_key_value_heads: int (GQA).
        head_dim: int.
        rope_max_wavelength: float, RoPE theta. Defaults to 1e6.
        rope_scaling_factor: float. Defaults to 1.0.
        activation: the MLP gate activation. Defaults to SiLU.
        layer_norm_epsilon: float, epsilon of every RMSNorm of the block (q/k
            norms included). Defaults to 1e-6.
        kernel_initializer: initializer of the kernels. Defaults to
            N(0, 0.02).
        dropout: float. Defaults to 0.
        sliding_window_size: int or `None` (full attention, as the paper).
        **kwargs: standard `keras.layers.Layer` arguments.

    Example:

    ```python
    block = keras_mhf.models.Qwen3DecoderBlock(
        intermediate_dim=64, num_query_heads=4, num_key_value_heads=2,
        head_dim=8,
    )
    block(np.zeros((1, 5, 32), "float32"))  # [1, 5, 32]
    ```
    """

    def __init__(
        self,
        intermediate_dim,
        num_query_heads,
        num_key_value_heads,
        head_dim,
        rope_max_wavelength=1_000_000,
        rope_scaling_factor=1.0,
        activation="silu",
        layer_norm_epsilon=1e-6,
        kernel_initializer=None,
        dropout=0.0,
        sliding_window_size=None,
        **kwargs,
    ):
        if kernel_initializer is None:
            kernel_initializer = keras.initializers.RandomNormal(stddev=0.02)
        super().__init__(
            intermediate_dim=intermediate_dim,
            num_query_heads=num_query_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            rope_max_wavelength=rope_max_wavelength,
            rope_scaling_factor=rope_scaling_factor,
            activation=activation,
            layer_norm_epsilon=layer_norm_epsilon,
            kernel_initializer=kernel_initializer,
            dropout=dropout,
            sliding_window_size=sliding_window_size,
            **kwargs,
        )

    def build(self, decoder_sequence_shape):
        super().build(decoder_sequence_shape)
        attention = self._self_attention_layer
        attention.layer_norm_epsilon = self.layer_norm_epsilon
        attention._query_dense_layer_norm.epsilon = self.layer_norm_epsilon
        attention._key_dense_layer_norm.epsilon = self.layer_norm_epsilon

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "head_dim": self.head_dim,
                "sliding_window_size": self.sliding_window_size,
            }
        )
        return config


def make_trunk_layers(
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
    """The Qwen3 stack: `(blocks named transformer_layer_<i>, final norm)`.

    Full attention (no sliding window), SiLU, N(0, 0.02) kernels, as the
    paper's Qwen3 backbone (Sec. 3.2).
    """
    blocks = [
        Qwen3DecoderBlock(
            intermediate_dim=intermediate_dim,
            num_query_heads=num_query_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            rope_max_wavelength=rope_max_wavelength,
            rope_scaling_factor=rope_scaling_factor,
            layer_norm_epsilon=layer_norm_epsilon,
            dropout=dropout,
            sliding_window_size=None,
            dtype=dtype,
            name=f"transformer_layer_{i}",
        )
        for i in range(num_layers)
    ]
    final_norm = Qwen3LayerNorm(
        epsilon=layer_norm_epsilon,
        dtype=dtype,
        name="sequence_output_layernorm",
    )
    return blocks, final_norm
