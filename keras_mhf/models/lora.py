"""LoRA fine-tuning of MultiHashFormer and Standard models.

KerasHub's `Backbone.enable_lora(rank)` freezes every weight and adds
low-rank factors `A` `[d_in, r]` and `B` `[r, d_out]` to the trunk's
attention query and value projections (Keras' `EinsumDense.enable_lora`):
the layer computes `x @ (W + (alpha / r) A @ B)` with `alpha = r` and `B`
initialised to zero, so a model with fresh adapters computes exactly what
the base model computes. This module adds what a supported fine-tuning path
needs on top of it:

- `enable_lora(lm, rank, train_tables=False)`: checked arguments (rank, a
  quantized model, a model that is not MHF or Standard, LoRA enabled twice)
  and, optionally, trainable hash tables (MHF: the `H` bucket tables `E(i)`
  of the encoder, tied to the decoder; Standard: the tied token embedding);
- `merge_lora(lm)`: folds every adapter into its kernel, in place
  (Keras 3.15 has no public merge; it merges only when it saves, see below);
- `lora_layers(lm)` and `unmerged_lora(lm)`: the adapted layers, and a
  context in which saving writes the frozen base kernels instead of the
  merged ones (what a resumable checkpoint needs).

Saving: Keras writes a LoRA layer's kernel *merged* (`save_weights`,
`save_to_preset`, `.keras`), and loading into a LoRA layer zeroes its
factors. So a preset saved from a LoRA model is a plain model holding the
merged kernels (it loads without LoRA), `backbone.save_lora_weights(path)`
(a `.lora.h5` file: the factors only) plus the base preset give the same
model back, and a training checkpoint must be written under
`unmerged_lora` with the factors beside it (`keras_mhf.pretraining` does).

Example:

```python
from keras_mhf.models.lora import enable_lora, merge_lora

lm = keras_hub.models.CausalLM.from_preset("runs/mhf/preset")
enable_lora(lm, rank=4)  # only the adapters train
lm.fit(texts, batch_size=8)
lm.backbone.save_lora_weights("adapter.lora.h5")  # the factors only
lm.save_to_preset("finetuned")  # a plain model, adapters merged
```
"""

import contextlib

import keras
import numpy as np

from keras_mhf.models.multi_hash_former.multi_hash_former_backbone import (
    MultiHashFormerBackbone,
)
from keras_mhf.models.standard.standard_backbone import StandardBackbone
from keras_mhf.utils.keras_private import flatten_layers


def _backbone(lm):
    backbone = getattr(lm, "backbone", lm)
    if not isinstance(backbone, (MultiHashFormerBackbone, StandardBackbone)):
        raise ValueError(
            "LoRA fine-tuning supports MultiHashFormer and Standard models "
            "(keras_mhf.models.MultiHashFormerCausalLM, StandardCausalLM or "
            f"their backbones); got {type(lm).__name__} with backbone "
            f"{type(backbone).__name__}."
        )
    return backbone


def _quantized_layers(backbone):
    return [
        layer.name
        for layer in flatten_layers(backbone, include_self=True)
        if getattr(layer, "quantization_mode", None) is not None
    ]


def lora_layers(lm):
    """The layers of `lm`'s backbone with LoRA enabled (empty without).

    Example:

    ```python
    enable_lora(lm, rank=4)
    [layer.name for layer in lora_layers(lm)]  # ["query", "value", ...]
    ```
    """
    backbone = getattr(lm, "backbone", lm)
    return [
        layer
        for layer in flatten_layers(backbone, include_self=False)
        if getattr(layer, "lora_enabled", False)
    ]


def enable_lora(lm, rank, train_tables=False, target_layer_names=None):
    """Freezes `lm` and adds rank-`rank` adapters to its trunk (KerasHub's
    `Backbone.enable_lora`: the attention query and value projections by
    default), optionally with trainable hash tables.

    Args:
        lm: a `MultiHashFormerCausalLM` or `StandardCausalLM` (or the
            backbone of one), float (not quantized), without LoRA yet.
        rank: the adapters' rank, an integer >= 1 (`alpha = rank`, so the
            update is `A @ B`).
        train_tables: also train the hash tables: an MHF model's `H` bucket
            tables (the encoder's `embeddings_i`, which the decoder's logits
            share; the gate, the output projection and the signature table
            stay frozen), a Standard model's tied token embedding. Useful
            after `expand_vocabulary`, where new tokens share old buckets.
        target_layer_names: names of the layers to adapt; default
            `backbone.default_lora_layer_names()` (`query`, `value`).

    Returns:
        `lm`, for chaining.

    Raises:
        ValueError: `rank` is not an integer >= 1, the model is quantized,
            is not an MHF or Standard model, already has LoRA, or no layer
            has one of `target_layer_names`.

    Example:

    ```python
    lm = MultiHashFormerCausalLM.from_tokenizer(tokenizer, "tiny_h4b1024")
    enable_lora(lm, rank=4)
    sum(int(np.prod(v.shape)) for v in lm.trainable_weights)  # 1,664
    ```
    """
    if (
        not isinstance(rank, (int, np.integer))
        or isinstance(rank, bool)
        or rank < 1
    ):
        raise ValueError(
            f"The LoRA rank must be an integer >= 1; got {rank!r}."
        )
    if not isinstance(train_tables, (bool, np.bool_)):
        raise ValueError(
            f"train_tables must be True or False; got {train_tables!r}."
        )
    backbone = _backbone(lm)
    quantized = _quantized_layers(backbone)
    if quantized:
        raise ValueError(
            "LoRA cannot be enabled on a quantized model (quantized layers: "
            + ", ".join(sorted(set(quantized))[:4])
            + "): fine-tune the float model, then quantize the result (a "
            "preset saved after fine-tuning holds the merged float weights)."
        )
    if lora_layers(backbone):
        raise ValueError(
            f"LoRA is already enabled on this model (rank "
            f"{getattr(backbone, '_lora_rank', '?')}); enable it once, on a "
            "model loaded without adapters."
        )
    targets = target_layer_names or backbone.default_lora_layer_names()
    if not any(
        layer.name in targets and hasattr(layer, "enable_lora")
        for layer in flatten_layers(backbone, include_self=False)
        if layer.weights
    ):  # checked first: KerasHub freezes the model before it looks
        raise ValueError(
            f"No layer of this model is named one of {list(targets)} (or "
            "supports LoRA); nothing was adapted. The trunk's projections "
            "are named query, key, value, attention_output, "
            "feedforward_gate_dense, feedforward_intermediate_dense and "
            "feedforward_output_dense."
        )
    backbone.enable_lora(int(rank), target_layer_names=targets)
    if train_tables:
        layer = (
            backbone.hash_encoder
            if isinstance(backbone, MultiHashFormerBackbone)
            else backbone.token_embedding
        )
        layer.trainable = True  # its own variables and its sublayers'
        for sublayer in flatten_layers(layer, include_self=False):
            sublayer.trainable = False  # the gate and output projection
    return lm


def merge_lora(lm):
    """Folds every LoRA adapter of `lm` into its kernel, in place:
    `W <- W + (alpha / r) A @ B` (computed in float32, stored in the
    kernel's dtype), then `B <- 0`.

    The model computes the same function before and after (up to float
    rounding of the sum); it keeps its adapters, now zero, so training can
    go on from the merged weights. Keras 3.15 has no public merge: it folds
    the adapters only into the kernels it writes when it saves.

    Returns:
        The number of layers merged.

    Example:

    ```python
    enable_lora(lm, rank=4)
    lm.fit(texts)
    merge_lora(lm)  # lm.backbone.save_lora_weights would now save zeros
    ```
    """
    layers = lora_layers(lm)
    for layer in layers:
        kernel = _base_kernel(layer)
        update = keras.ops.matmul(
            keras.ops.cast(layer.lora_kernel_a, "float32"),
            keras.ops.cast(layer.lora_kernel_b, "float32"),
        ) * (layer.lora_alpha / layer.lora_rank)
        merged = keras.ops.add(keras.ops.cast(kernel, "float32"), update)
        kernel.assign(keras.ops.cast(merged, kernel.dtype))
        layer.lora_kernel_b.assign(keras.ops.zeros(layer.lora_kernel_b.shape))
    return len(layers)


def _base_kernel(layer):
    """The frozen kernel variable of a LoRA layer (its `kernel` property is
    the merged tensor)."""
    for variable in layer.variables:
        if variable.name == "kernel":
            return variable
    raise ValueError(f"The LoRA layer {layer.path} has no kernel variable.")


@contextlib.contextmanager
def unmerged_lora(lm):
    """Inside it, saving `lm` (`save_weights`) writes its LoRA layers' frozen
    base kernels instead of the merged ones Keras writes, so that the
    saved weights plus `backbone.save_lora_weights` are the exact training
    state. Loading such a file into a LoRA model (`load_weights`, which
    zeroes the factors), then `backbone.load_lora_weights`, restores it.

    Example:

    ```python
    with unmerged_lora(lm):
        lm.save_weights("model.weights.h5")
    lm.backbone.save_lora_weights("model.lora.h5")
    ```
    """
    layers = lora_layers(lm)
    for layer in layers:
        layer.lora_enabled = False  # `kernel` is then the base kernel
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_enabled = True
