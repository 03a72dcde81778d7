"""Quantization of MultiHashFormer models, the Keras way.

`keras.Model.quantize` quantizes every leaf layer it finds (`Dense`,
`EinsumDense`) with the mode's Keras quantizers; for `"gptq"` and `"awq"` it
then calibrates the blocks that `get_quantization_layer_structure` names.
Two things of a MultiHashFormer it cannot do alone, and this module does:

- the hash encoder's bucket tables (the largest weights of the model, read
  by the encoder's lookup and by the tied decoder): `HashEncoder` holds
  sublayers, so `Model.quantize` never calls its `quantize`.
  `quantize_hash_tables` does, with Keras' quantizers (per-row abs-max
  int8/int4, or grouped int4; see `HashEncoder.quantize`). Under GPTQ/AWQ
  the tables take that path too, at the config's bit width (`int4` for
  `weight_bits <= 4`, else `int8`): they are looked up and used as tied
  output tables, not `Dense` kernels with calibration inputs;
- the structure GPTQ/AWQ need (`quantization_layer_structure`): the
  signature lookup and hash encoder before the blocks, then the trunk's
  Qwen3 blocks in order.

Under GPTQ/AWQ only the layers inside the blocks are put in the GPTQ/AWQ
mode (they are calibrated); the encoder's gate and output projections and
the cascade mixers stay float (Keras would otherwise leave them in an
uncalibrated GPTQ/AWQ mode, which a saved model cannot reload), as do the
norms. The preprocessing layers are never touched (they hold no weights,
and Keras refuses a reloaded tokenizer, which is never "built").

`filters` follow `Model.quantize`'s documented contract (a regex on
`layer.name`, a list of them, or a callable); this module implements it
rather than import Keras' private `should_quantize_layer`.
"""

import contextlib
import gc
import re

import keras

from keras_mhf.layers.hash_encoder import TABLE_QUANTIZATION_MODES
from keras_mhf.layers.hash_encoder import check_table_quantization_config
from keras_mhf.utils.keras_private import flatten_layers
from keras_mhf.utils.keras_private import post_quantize

STRUCTURED_MODES = ("gptq", "awq")


def matches_filters(layer, filters):
    """Whether `Model.quantize(filters=...)` selects `layer`: `None` selects
    every layer; a regex string or a list of them is searched in
    `layer.name`; a callable is called with the layer.

    Example:

    ```python
    matches_filters(layer, ["query", "key"])
    ```
    """
    if filters is None:
        return True
    if isinstance(filters, str):
        return bool(re.search(filters, layer.name))
    if isinstance(filters, (list, tuple)):
        return any(re.search(pattern, layer.name) for pattern in filters)
    if callable(filters):
        return bool(filters(layer))
    raise ValueError(
        "The `filters` argument must be a regex string, a list of regex "
        f"strings, or a callable. Received: {type(filters)}"
    )


def skip_preprocessing_filter(preprocessor, filters):
    """`Model.quantize` filters (a callable) that select what `filters`
    selects, except the layers of `preprocessor` and every layer without
    weights (nothing to quantize, and Keras refuses a layer that is not
    "built", e.g. a reloaded tokenizer or a weightless helper layer).

    Example:

    ```python
    keras.Model.quantize(
        lm, "int8", filters=skip_preprocessing_filter(lm.preprocessor, None)
    )
    ```
    """
    skipped = set()
    if preprocessor is not None:
        skipped = {id(layer) for layer in flatten_layers(preprocessor)}

    def keep(layer):
        if id(layer) in skipped or not layer.weights:
            return False
        return matches_filters(layer, filters)

    return keep


def quantization_layer_structure(backbone, mode):
    """What GPTQ/AWQ calibrate, for `Model.get_quantization_layer_structure`:
    `{"pre_block_layers": [signature_lookup, hash_encoder],
    "sequential_blocks": transformer_layers}` for a `MultiHashFormerBackbone`
    (or, for a backbone with a `token_embedding`, that embedding before the
    blocks, as KerasHub's `CausalLM` does); `None` for other modes. Keras
    feeds int32 token ids `[1, s]` through the pre-block layers (ids ->
    signatures -> embeddings) and calibrates the blocks in order, each on
    the previous block's outputs. The bucket tables are not in a block:
    they keep their own int8/int4 path (`quantize_hash_tables`).

    Example:

    ```python
    structure = quantization_layer_structure(lm.backbone, "gptq")
    ```
    """
    if mode not in STRUCTURED_MODES:
        return None
    blocks = list(getattr(backbone, "transformer_layers", None) or [])
    if not blocks:
        return None
    encoder = getattr(backbone, "hash_encoder", None)
    if encoder is not None:
        pre_block_layers = [backbone.signature_lookup, encoder]
    elif getattr(backbone, "token_embedding", None) is not None:
        pre_block_layers = [backbone.token_embedding]
    else:
        return None
    return {"pre_block_layers": pre_block_layers, "sequential_blocks": blocks}


def table_quantization(mode, config=None):
    """`(mode, config)` for the bucket tables when a model is quantized with
    `mode` and `config`: int8/int4 as given (a config the tables cannot
    honour is refused here, before any layer changes); GPTQ/AWQ at the
    config's bit width (`"int4"` in groups of the config's `group_size`
    along `d` for `weight_bits <= 4`, else `"int8"`); `(None, None)` for
    float8 (mixed precision training: the tables stay float, as Keras'
    `Embedding`).

    Raises:
        ValueError: an unknown mode, a config that does not fit the mode, or
            a table config `HashEncoder.quantize` would refuse.
    """
    if mode in TABLE_QUANTIZATION_MODES:
        check_table_quantization_config(mode, config)
        return mode, config
    if mode in STRUCTURED_MODES:
        expected = getattr(keras.quantizers, f"{mode.upper()}Config")
        if not isinstance(config, expected):
            name = expected.__name__
            raise ValueError(
                f"quantize({mode!r}) needs `config=keras.quantizers.{name}("
                f"dataset=..., tokenizer=...)` (the calibration data); got "
                f"{type(config).__name__}."
            )
        if config.weight_bits > 4:
            return "int8", None
        # The tables' groups along d follow the config's groups.
        return "int4", keras.quantizers.Int4QuantizationConfig(
            block_size=config.group_size
        )
    if mode == "float8":
        return None, None
    raise ValueError(
        "Invalid quantization mode for a MultiHashFormer model. Expected one "
        f"of {TABLE_QUANTIZATION_MODES + STRUCTURED_MODES + ('float8',)}. "
        f"Received: mode={mode!r}"
    )


def _resolve_mode(mode, config):
    """`mode`, or the config's mode when only a config is given (as
    `keras.Model.quantize` resolves it)."""
    if mode is None and config is not None:
        return config.mode
    return mode


def quantize_hash_tables(backbone, mode, config=None, filters=None):
    """Quantizes the hash encoder's bucket tables of `backbone` for a model
    quantized with `mode`/`config` (see `table_quantization`), unless they
    are quantized already or `filters` leaves `hash_encoder` out.

    Example:

    ```python
    quantize_hash_tables(lm.backbone, "int8")
    ```
    """
    mode = _resolve_mode(mode, config)
    table_mode, table_config = table_quantization(mode, config)
    encoder = backbone.hash_encoder
    if table_mode is None or encoder.quantization_mode is not None:
        return
    if not matches_filters(encoder, filters):
        return
    encoder.quantize(table_mode, config=table_config)
    post_quantize(backbone, table_mode)


def _block_layer_filter(structure, filters):
    """`filters` restricted to the layers inside the structure's blocks."""
    inside = {
        id(layer)
        for block in structure["sequential_blocks"]
        for layer in flatten_layers(block)
    }

    def keep(layer):
        return id(layer) in inside and matches_filters(layer, filters)

    return keep


def _structure(model, mode, config):
    """The GPTQ/AWQ structure `keras.Model.quantize` will use (`None` for
    other modes, or when there is none: Keras then raises its own error)."""
    if mode not in STRUCTURED_MODES:
        return None
    structure = config.quantization_layer_structure
    if structure is None:
        structure = model.get_quantization_layer_structure(mode)
    return structure


def _model_filters(structure, filters, preprocessor=None):
    """The filters `keras.Model.quantize` gets: no preprocessing layer and,
    under GPTQ/AWQ, only the layers of the calibrated blocks."""
    if structure is not None:
        filters = _block_layer_filter(structure, filters)
    return skip_preprocessing_filter(preprocessor, filters)


def _is_calibrated(layer):
    return bool(
        getattr(layer, "is_gptq_calibrated", False)
        or getattr(layer, "is_awq_calibrated", False)
    )


@contextlib.contextmanager
def _calibration_reaches_hooks(structure):
    """Works around a Keras 3.15 bug while GPTQ/AWQ run: Keras collects the
    calibration statistics (GPTQ's Hessians, AWQ's activation magnitudes)
    by replacing each target layer's `call`, but a layer in GPTQ/AWQ mode is
    dispatched to `quantized_call` (`_gptq_call` / `_awq_call`), which never
    calls `call`: every statistic stays zero, and GPTQ and AWQ silently
    reduce to plain round-to-nearest. Here, until a block layer is
    calibrated, its `quantized_call` runs `call` instead (what
    `_gptq_call`/`_awq_call` compute before calibration: the float kernel,
    so the numbers are the same) and the hook sees the activations; the
    instance attributes are removed afterwards. Without a structure this
    does nothing."""
    layers = []
    if structure is not None:
        layers = [
            layer
            for block in structure["sequential_blocks"]
            for layer in flatten_layers(block)
            if len(list(flatten_layers(layer))) == 1
        ]
    for layer in layers:

        def dispatch(*args, _layer=layer, **kwargs):
            if _is_calibrated(_layer):
                return type(_layer).quantized_call(_layer, *args, **kwargs)
            return _layer.call(*args, **kwargs)  # Keras' hook, if installed

        layer.quantized_call = dispatch
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("quantized_call", None)


@contextlib.contextmanager
def _one_garbage_collection():
    """Quantizing replaces every float kernel, and Keras' `Layer.__delattr__`
    runs a full `gc.collect()` after each deleted variable (so a device
    buffer is freed at once): hundreds of collections for one model, each
    as slow as the process is large (seconds in a process holding other
    models). Inside the block those calls are skipped; one collection runs
    at its end, which frees the same buffers. The cost: float kernels that
    only a reference cycle keeps alive are freed at the end rather than
    one by one, so the peak is at most the float model plus its quantized
    copy (about 1.25x the float model for int8)."""
    collect = gc.collect
    gc.collect = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        gc.collect = collect
        gc.collect()


def _quantize(
    model,
    backbone,
    preprocessor,
    model_quantize,
    mode,
    config,
    filters,
    **kwargs,
):
    """`model_quantize` (Keras' `Model.quantize` of `model`) over the Dense
    layers, not `preprocessor`'s, only the blocks' under GPTQ/AWQ (with
    their statistics reaching Keras' calibration), then `backbone`'s bucket
    tables; an unsupported mode or table config is refused first."""
    mode = _resolve_mode(mode, config)
    table_quantization(mode, config)  # refuse before anything changes
    structure = _structure(model, mode, config)
    with _one_garbage_collection():
        with _calibration_reaches_hooks(structure):
            model_quantize(
                mode,
                config=config,
                filters=_model_filters(structure, filters, preprocessor),
                **kwargs,
            )
        quantize_hash_tables(backbone, mode, config, filters)


def quantize_backbone(
    backbone, model_quantize, mode=None, config=None, filters=None, **kwargs
):
    """`MultiHashFormerBackbone.quantize`: Keras' `Model.quantize`
    (`model_quantize`, the backbone's `super().quantize`) over the Dense
    layers (only the blocks' under GPTQ/AWQ), then the bucket tables.

    Example:

    ```python
    quantize_backbone(backbone, super().quantize, "int8")  # in `quantize`
    ```
    """
    _quantize(
        backbone,
        backbone,
        None,
        model_quantize,
        mode,
        config,
        filters,
        **kwargs,
    )


def quantize_causal_lm(
    task, model_quantize, mode=None, config=None, filters=None, **kwargs
):
    """The model part of `MultiHashFormerCausalLM.quantize`: Keras'
    `Model.quantize` (`model_quantize`, the task's `super().quantize`) over
    the Dense layers (not the preprocessor's; only the blocks' under
    GPTQ/AWQ, which it then calibrates through the task's
    `get_quantization_layer_structure`), then the bucket tables
    (`quantize_hash_tables`). An unsupported mode or table config is
    refused before any layer changes. Then what depends on the old weights
    is reset: the compiled functions and scorers, and a built optimizer (the
    task is recompiled with a fresh one of the same config).

    Example:

    ```python
    quantize_causal_lm(lm, super(type(lm), lm).quantize, "int8")
    ```
    """
    from keras_mhf.models.next_token_scorer import forget_compiled

    _quantize(
        task,
        task.backbone,
        task.preprocessor,
        model_quantize,
        mode,
        config,
        filters,
        **kwargs,
    )
    forget_compiled(task)
    optimizer = getattr(task, "optimizer", None)
    if optimizer is not None and optimizer.built:
        task.compile(
            optimizer=type(optimizer).from_config(optimizer.get_config()),
            loss=task.loss,
            sampler=task.sampler,
        )


class TableQuantizationMixin:
    """Keras' two quantization hooks for a MultiHashFormer task, mixed in
    before KerasHub's `CausalLM`: `quantize` (`keras.Model.quantize` plus
    the bucket tables, `quantize_causal_lm`; the model is then for
    inference, its optimizer rebuilt) and `get_quantization_layer_structure`
    (what GPTQ/AWQ calibrate: the encoder, then the blocks in order).

    Example:

    ```python
    lm.quantize("int8")  # Dense kernels and the bucket tables
    ```
    """

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """`keras.Model.quantize` (`"int8"`, `"int4"`, `"gptq"`, `"awq"`)
        plus the bucket tables; see `quantize_causal_lm`."""
        quantize_causal_lm(
            self, super().quantize, mode, config, filters, **kwargs
        )

    def get_quantization_layer_structure(self, mode=None):
        """What GPTQ/AWQ calibrate: the encoder, then the blocks in order."""
        return quantization_layer_structure(self.backbone, mode)
