"""The Qwen3 decoder block shared by MultiHashFormer and the Standard baseline.

It also holds the trunk both backbones share (`make_trunk_layers`,
`trunk_graph`, `TRUNK_ARGUMENTS`): the blocks, the final norm and the
functional graph `token_ids -> embedding -> blocks -> norm`, so the two
backbones differ only in their embedding. KerasHub's private Qwen3 classes
come from `keras_mhf.utils.keras_private` (the one module that imports
`keras_hub.src`); keras-hub is pinned to the tested minor version (0.32).

KerasHub 0.32 workarounds, all in `Qwen3DecoderBlock` and nowhere else (the
stock classes are never modified, so KerasHub's own Qwen3 models in the same
process behave exactly as without `keras_mhf`):

- the q/k RMSNorms of `Qwen3TransformerDecoder` ignore the block's
  `layer_norm_epsilon` (they stay at 1e-5; Hugging Face Qwen3 uses
  `rms_norm_eps` everywhere): `build` sets them to the block's epsilon;
- `Qwen3TransformerDecoder.get_config` omits `head_dim` and
  `sliding_window_size`, so the stock block cannot be rebuilt from its
  config: `get_config` adds them;
- the attention broadcasts its mask with `mask[:, None, :, :]`, which the
  LiteRT converter can only lower to a Flex (select TF) op that LiteRT
  interpreters without the Flex delegate refuse: `build` gives the block's
  attention a `_masked_softmax` that uses `ops.expand_dims` (a builtin;
  the same numbers), so `export(..., format="litert")` runs anywhere.
"""

import os
import warnings

import keras

from keras_mhf.utils.keras_private import Qwen3LayerNorm
from keras_mhf.utils.keras_private import Qwen3TransformerDecoder
from keras_mhf.utils.keras_private import fix_qwen3_attention
from keras_mhf.utils.keras_utils import rematerialized

# The constructor arguments of the Qwen3 trunk, in the order the backbones'
# `get_config` lists them: its weight dimensions, then its options.
TRUNK_DIMENSIONS = (
    "num_layers",
    "num_query_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_dim",
    "intermediate_dim",
)
TRUNK_OPTIONS = (
    "rope_max_wavelength",
    "rope_scaling_factor",
    "layer_norm_epsilon",
    "dropout",
    "rematerialize",
)
TRUNK_ARGUMENTS = TRUNK_DIMENSIONS + TRUNK_OPTIONS
# ... and those of them each block takes.
_BLOCK_ARGUMENTS = (
    "intermediate_dim",
    "num_query_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_max_wavelength",
    "rope_scaling_factor",
    "layer_norm_epsilon",
    "dropout",
    "rematerialize",
)


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
        rematerialize: bool. If True, a training call keeps only the block's
            input for the backward pass and recomputes the block's
            activations there (gradient checkpointing, `keras.remat`): the
            trunk's activation memory becomes one block's instead of every
            block's, for about one more forward pass of compute. The same
            numbers; refused with `dropout > 0` (the recomputed pass must
            draw the same mask). Defaults to False.
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
        rematerialize=False,
        **kwargs,
    ):
        if rematerialize and dropout:
            raise ValueError(
                f"Qwen3DecoderBlock: rematerialize=True needs dropout=0 (got "
                f"dropout={dropout}): the backward pass recomputes the block "
                "and must see the same dropout mask. Train with dropout=0 or "
                "rematerialize=False."
            )
        self.rematerialize = bool(rematerialize)
        if self.rematerialize:
            _warn_if_xla_cpu_schedules_for_concurrency()
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
        fix_qwen3_attention(self)

    def call(
        self,
        decoder_sequence,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        training=None,
    ):
        arguments = dict(
            decoder_padding_mask=decoder_padding_mask,
            decoder_attention_mask=decoder_attention_mask,
            self_attention_cache=self_attention_cache,
            self_attention_cache_update_index=self_attention_cache_update_index,
            training=training,
        )
        if not (
            self.rematerialize and training and self_attention_cache is None
        ):
            return super().call(decoder_sequence, **arguments)

        def block(sequence):
            return super(Qwen3DecoderBlock, self).call(sequence, **arguments)

        return rematerialized(self.variables, block)(decoder_sequence)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "head_dim": self.head_dim,
                "sliding_window_size": self.sliding_window_size,
                "rematerialize": self.rematerialize,
            }
        )
        return config


# XLA's CPU scheduler that runs independent ops concurrently (the default)
# ignores memory: it moves the backward pass's recomputation of every
# rematerialised block to its start, so `keras.remat` saves nothing there.
XLA_CPU_MEMORY_SCHEDULER = (
    "--xla_cpu_enable_concurrency_optimized_scheduler=false"
)


def _warn_if_xla_cpu_schedules_for_concurrency():
    if keras.config.backend() != "jax":
        return
    flag = XLA_CPU_MEMORY_SCHEDULER.split("=")[0]
    on_cpu = keras.distribution.list_devices()[0].startswith("cpu")
    if on_cpu and flag not in os.environ.get("XLA_FLAGS", ""):
        warnings.warn(
            "rematerialize=True on JAX's CPU backend saves no memory under "
            "XLA's default CPU scheduler, which recomputes every block at "
            "the start of the backward pass. Start the process with "
            f"XLA_FLAGS={XLA_CPU_MEMORY_SCHEDULER} (accelerators need "
            "nothing).",
            stacklevel=3,
        )


def trunk_arguments(arguments):
    """The `TRUNK_ARGUMENTS` entries of `arguments` (a backbone's
    constructor arguments, e.g. its `locals()` or `get_config()`)."""
    return {name: arguments[name] for name in TRUNK_ARGUMENTS}


def make_trunk_layers(trunk, dtype):
    """The Qwen3 stack: `(blocks named transformer_layer_<i>, final norm)`.

    `trunk` holds the `TRUNK_ARGUMENTS` (`trunk_arguments`). Full attention
    (no sliding window), SiLU, N(0, 0.02) kernels, as the paper's Qwen3
    backbone (Sec. 3.2); layer names as KerasHub's `Qwen3Backbone`.
    """
    block_arguments = {name: trunk[name] for name in _BLOCK_ARGUMENTS}
    blocks = [
        Qwen3DecoderBlock(
            **block_arguments,
            sliding_window_size=None,
            dtype=dtype,
            name=f"transformer_layer_{i}",
        )
        for i in range(trunk["num_layers"])
    ]
    final_norm = Qwen3LayerNorm(
        epsilon=trunk["layer_norm_epsilon"],
        dtype=dtype,
        name="sequence_output_layernorm",
    )
    return blocks, final_norm


def trunk_graph(embed, blocks, final_norm):
    """The backbones' functional graph: `(inputs, sequence_output)` for
    `keras.Model.__init__`, with inputs `{"token_ids", "padding_mask"}`
    (int32 `[b, s]`) and `final_norm(blocks(embed(token_ids)))` (each block
    masked by `padding_mask`) as the output. `embed` maps token ids to the
    input embeddings `[b, s, d]` (it is called first, so its weights are
    drawn before the trunk's).
    """
    token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
    padding_mask = keras.Input(
        shape=(None,), dtype="int32", name="padding_mask"
    )
    x = embed(token_ids)
    for block in blocks:
        x = block(x, decoder_padding_mask=padding_mask)
    inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
    return inputs, final_norm(x)
