"""Every private Keras / KerasHub name that `keras_mhf` uses, in one place.

`keras.src` and `keras_hub.src` are not public APIs: they may move or change
in any release. `keras_mhf` imports them here and nowhere else, each with the
reason no public API does the job, so an upgrade (keras-hub is pinned to the
tested minor version, 0.32, because of these) is checked in one file. Import
them from this module, e.g.
`from keras_mhf.utils.keras_private import Qwen3TransformerDecoder`.

Public APIs used instead of private ones: quantization (`keras.quantizers`:
`abs_max_quantize`, `AbsMaxQuantizer`, `pack_int4`, the `*Config` classes),
and the `filters` of `Model.quantize`, whose documented contract (a regex on
`layer.name`, a list of them, or a callable) `keras_mhf.models.quantization`
implements itself rather than importing `keras.src.quantizers.utils`.
"""

import functools

import keras

# `scale_loss_for_distribution(loss)`: how Keras' `Loss` reduction scales a
# loss for the active distribution (divides by the replicas on TensorFlow);
# the fused MultiHashFormer training loss, which bypasses `Loss`, must scale
# the same way. Not exported.
from keras.src.losses.loss import scale_loss_for_distribution

# The Qwen3 decoder block of the paper's trunk (Sec. 3.2). KerasHub exports
# `Qwen3Backbone` but not its block; `keras_mhf.models.Qwen3DecoderBlock`
# subclasses it (fixing its 0.32 bugs) so that both backbones reuse
# KerasHub's attention, RoPE, KV cache and weight layout.
from keras_hub.src.models.qwen3.qwen3_decoder import Qwen3TransformerDecoder

# Qwen3's RMSNorm (float32 maths, the input dtype out): the final norm of
# both backbones, so that the Standard baseline computes exactly what
# KerasHub's `Qwen3Backbone` computes. Not exported by KerasHub
# (`keras.layers.RMSNormalization` computes in the compute dtype).
from keras_hub.src.models.qwen3.qwen3_layernorm import Qwen3LayerNorm

# KerasHub's Hugging Face Qwen3 converter (`convert_weights`) and its
# safetensors reader: the stock Qwen3 layers of an authors' checkpoint load
# exactly as `Qwen3Backbone.from_preset("hf://...")` would load them. Only
# the public `from_preset` entry point is exported.
from keras_hub.src.utils.transformers import convert_qwen3
from keras_hub.src.utils.transformers.safetensor_utils import SafetensorLoader

__all__ = [
    "Qwen3LayerNorm",
    "Qwen3TransformerDecoder",
    "SafetensorLoader",
    "convert_qwen3",
    "additional_loss",
    "flatten_layers",
    "fix_qwen3_attention",
    "normalize_generate_outputs",
    "parallel_update_step",
    "post_quantize",
    "qwen3_block_sublayers",
    "scale_loss_for_distribution",
    "set_parallel_update_step",
    "set_value_in_place",
]


def flatten_layers(layer, include_self=True):
    """Every layer tracked under `layer` (itself first with
    `include_self`), each once, in order: Keras' private
    `Layer._flatten_layers`. The public `Model.layers` lists only the top
    level, and a `Layer` holding sublayers (`HashEncoder`, the Qwen3 block)
    has no public walk.

    Example:

    ```python
    dense = [l for l in flatten_layers(backbone) if isinstance(l, Dense)]
    ```
    """
    return layer._flatten_layers(include_self=include_self)


def fix_qwen3_attention(block):
    """Fixes KerasHub 0.32's `Qwen3Attention` of a built Qwen3 `block`
    (see `keras_mhf.models.qwen3_decoder_block`): the q/k norms take the
    block's `layer_norm_epsilon` (they ignore it), and the mask is
    broadcast over heads with `ops.expand_dims` (a LiteRT builtin) instead
    of `[:, None, :, :]`, the same numbers. Private: the attention, its
    norms and its softmax are attributes of the block only
    (`_self_attention_layer`, `_query_dense_layer_norm`, `_masked_softmax`).
    """
    attention = block._self_attention_layer
    epsilon = block.layer_norm_epsilon
    attention.layer_norm_epsilon = epsilon
    attention._query_dense_layer_norm.epsilon = epsilon
    attention._key_dense_layer_norm.epsilon = epsilon
    if hasattr(attention, "_masked_softmax"):
        attention._masked_softmax = functools.partial(
            _masked_softmax, attention
        )


def _masked_softmax(attention, attention_scores, attention_mask=None):
    """`Qwen3Attention._masked_softmax` with the mask broadcast over heads
    by `ops.expand_dims` (a LiteRT builtin) instead of `[:, None, :, :]`."""
    if attention_mask is not None:
        attention_mask = keras.ops.expand_dims(attention_mask, 1)
        return attention._softmax(attention_scores, attention_mask)
    return attention._softmax(attention_scores)


def set_value_in_place(variable, value):
    """Makes `value` the value of a Keras `variable` as it is (its private
    `_value`): `assign` would lay a whole value out again over the
    processes of a distribution (`distribution.whole_weights`)."""
    variable._value = value


def qwen3_block_sublayers(block):
    """The named sublayers of a Qwen3 decoder block, as HF Qwen3 names their
    weights: `input_layernorm`, `q_proj`, `q_norm`, `k_proj`, `k_norm`,
    `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`,
    `post_attention_layernorm`. Private: KerasHub's block and attention
    keep them as attributes only (`_query_dense`, ...); its converter reads
    them the same way."""
    attention = block._self_attention_layer
    return {
        "input_layernorm": block._self_attention_layernorm,
        "q_proj": attention._query_dense,
        "q_norm": attention._query_dense_layer_norm,
        "k_proj": attention._key_dense,
        "k_norm": attention._key_dense_layer_norm,
        "v_proj": attention._value_dense,
        "o_proj": attention._output_dense,
        "gate_proj": block._feedforward_gate_dense,
        "up_proj": block._feedforward_intermediate_dense,
        "down_proj": block._feedforward_output_dense,
        "post_attention_layernorm": block._feedforward_layernorm,
    }


def additional_loss(model, loss):
    """A layer's `add_loss` term as Keras' `compute_loss` adds it to the
    compiled loss (`Trainer._aggregate_additional_loss`: scaled for the
    distribution); the fused MultiHashFormer loss, which replaces
    `compute_loss`'s, must add them the same way."""
    return model._aggregate_additional_loss(loss)


def normalize_generate_outputs(causal_lm, outputs, input_is_scalar):
    """KerasHub's `CausalLM._normalize_generate_outputs`: the batches of a
    generation joined and unbatched as `generate` returns them (strings or
    token ids, a scalar for a scalar input)."""
    return causal_lm._normalize_generate_outputs(outputs, input_is_scalar)


def post_quantize(model, mode):
    """What Keras' `Model.quantize` does after changing layers
    (`Model._post_quantize`: on PyTorch, re-tracks the variables so that
    the replaced float ones can be freed); run after quantizing the bucket
    tables, which `Model.quantize` does not reach."""
    model._post_quantize(mode)


def parallel_update_step(optimizer):
    """The optimizer's update of all variables at once
    (`BaseOptimizer._parallel_update_step`, on PyTorch), or `None`."""
    return getattr(optimizer, "_parallel_update_step", None)


def set_parallel_update_step(optimizer, update):
    """Replaces `parallel_update_step(optimizer)` on this instance."""
    optimizer._parallel_update_step = update

