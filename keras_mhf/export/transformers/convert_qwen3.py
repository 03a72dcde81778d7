"""Reads a stock Hugging Face `Qwen3ForCausalLM` checkpoint (such as
`export_qwen3` writes) into a `StandardCausalLM`: the trunk is ported with
KerasHub's own Qwen3 converter, with the strict loader of
`keras_mhf.export.transformers.convert_multi_hash_former` (safetensors only; every tensor must
be used and have the expected shape). `StandardCausalLM.from_preset(path)`
calls it for such a directory."""

import json
import os

from keras_mhf.export.transformers import convert_multi_hash_former
from keras_mhf.export.transformers.sentencepiece_tokenizer_files import (
    checkpoint_tokenizer,
)
from keras_mhf.utils.keras_private import convert_qwen3


def is_qwen3_checkpoint(preset):
    """True for a local directory with a Hugging Face Qwen3 `config.json`
    (`model_type` "qwen3") that is not a MultiHashFormer checkpoint."""
    config, _ = convert_multi_hash_former.checkpoint_config(preset)
    return (
        isinstance(config, dict)
        and config.get("model_type") == "qwen3"
        and not convert_multi_hash_former.is_multi_hash_former_config(config)
    )


def _backbone_kwargs(directory):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    if not config.get("tie_word_embeddings", False):
        raise ValueError(
            f"{path}: tie_word_embeddings must be true; the Standard "
            "baseline ties its embedding and LM head."
        )
    if config.get("attention_bias") or config.get("use_sliding_window"):
        raise ValueError(
            f"{path}: attention biases and sliding-window attention are "
            "not part of the Standard baseline."
        )
    rope = config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "linear"):
        raise ValueError(
            f"{path}: rope_type={rope_type!r} is not supported; only "
            "'default' and 'linear'."
        )
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    return dict(
        vocabulary_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        num_query_heads=heads,
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or hidden // heads,
        hidden_dim=hidden,
        intermediate_dim=config["intermediate_size"],
        rope_max_wavelength=rope.get(
            "rope_theta", config.get("rope_theta", 1_000_000)
        ),
        rope_scaling_factor=float(rope.get("factor", 1.0))
        if rope_type == "linear"
        else 1.0,
        layer_norm_epsilon=config["rms_norm_eps"],
        dropout=config.get("attention_dropout", 0.0),
    )


class _TiedView:
    """What KerasHub's Qwen3 converter expects of a backbone."""

    def __init__(self, backbone):
        self.num_layers = backbone.num_layers
        self.tie_word_embeddings = True
        self.get_layer = backbone.get_layer


def load_qwen3_checkpoint(
    task_cls,
    directory,
    load_weights=True,
    tokenizer=None,
    dtype=None,
    sequence_length=1024,
):
    """Builds a `task_cls` (`StandardCausalLM`) from a Hugging Face Qwen3
    checkpoint directory.

    Args:
        task_cls: the causal-LM class to build (its `backbone_cls` and
            `preprocessor_cls` are used).
        directory: local checkpoint directory.
        load_weights: whether to read the weights.
        tokenizer: a `MultiHashFormerTokenizer` or a SentencePiece `.model`
            path; defaults to the directory's `tokenizer.model`.
        dtype: dtype policy.
        sequence_length: the preprocessor's packed length.

    Example:

    ```python
    standard = load_qwen3_checkpoint(StandardCausalLM, "exported_standard")
    ```
    """
    directory = str(directory)
    preprocessor_cls = task_cls.preprocessor_cls
    tokenizer_cls = preprocessor_cls.tokenizer_cls
    backbone = task_cls.backbone_cls(dtype=dtype, **_backbone_kwargs(directory))
    tokenizer = checkpoint_tokenizer(directory, tokenizer, tokenizer_cls)
    if tokenizer is not None and (
        tokenizer.vocabulary_size() != backbone.vocabulary_size
    ):
        raise ValueError(
            f"The tokenizer has {tokenizer.vocabulary_size()} tokens but the "
            f"checkpoint in {directory} has vocab_size="
            f"{backbone.vocabulary_size}."
        )
    if load_weights:
        convert_multi_hash_former.check_weight_files(directory)
        with convert_multi_hash_former.CheckedLoader(directory) as loader:
            convert_qwen3.convert_weights(_TiedView(backbone), loader, None)
            loader.check_all_used()
    preprocessor = (
        preprocessor_cls(tokenizer, sequence_length=sequence_length)
        if tokenizer is not None
        else None
    )
    return task_cls(backbone=backbone, preprocessor=preprocessor)
