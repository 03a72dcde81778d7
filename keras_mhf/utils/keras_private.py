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
    "scale_loss_for_distribution",
]
