"""The Standard / Standard+kL baseline (paper Sec. 4.1, "Baselines")."""

import keras
from keras_hub.models import Qwen3Backbone
from keras_hub.models import Qwen3CausalLM

# Imported for its fix of the q/k-norm epsilon of KerasHub's Qwen3 block.
import keras_mhf.models.qwen3_trunk  # noqa: F401

from keras_mhf.models.multi_hash_former_architectures import parse_architecture
from keras_mhf.models.multi_hash_former_causal_lm_preprocessor import (
    MultiHashFormerCausalLMPreprocessor,
)


def standard_backbone(
    vocabulary_size, architecture="tiny", extra_layers=0, dtype=None, **backbone_kwargs
):
    """The Standard baseline's `Qwen3Backbone` (see `standard_causal_lm`),
    for a vocabulary size without a tokenizer (e.g. benchmarks)."""
    trunk, _ = parse_architecture(architecture)
    trunk["num_layers"] += int(extra_layers)
    trunk.update(backbone_kwargs)
    epsilon = trunk.pop("layer_norm_epsilon", 1e-6)
    backbone = Qwen3Backbone(
        vocabulary_size=vocabulary_size,
        rope_max_wavelength=trunk.pop("rope_max_wavelength", 1_000_000),
        layer_norm_epsilon=epsilon,
        tie_word_embeddings=True,
        sliding_window_size=None,
        dtype=dtype,
        **trunk,
    )
    # The authors initialise the embedding N(0, 0.02) (KerasHub uses 0.01).
    embeddings = backbone.token_embedding.embeddings
    embeddings.assign(
        keras.initializers.RandomNormal(stddev=0.02)(embeddings.shape, embeddings.dtype)
    )
    return backbone


def standard_causal_lm(
    tokenizer,
    architecture="tiny",
    extra_layers=0,
    sequence_length=1024,
    dtype=None,
    **backbone_kwargs,
):
    """KerasHub's own `Qwen3CausalLM` on the same trunk and tokenizer as MHF.

    A vocabulary-sized tied embedding matrix replaces the hash interface;
    everything else (Qwen3 blocks, RoPE theta 1e6, RMSNorm eps 1e-6 on every
    norm including q/k, full attention, N(0, 0.02) initialisation) matches
    `MultiHashFormerBackbone`. `extra_layers=k` gives the paper's
    Standard+kL. The model is compiled with a token cross-entropy averaged
    over unmasked positions, like `SignatureCrossEntropy`.

    Args:
        tokenizer: a `MultiHashFormerTokenizer` (shared with the MHF model).
        architecture: a trunk name (`"100m"`, `"1b"`, `"tiny"`, ...) or a full
            MHF name (its hash part is ignored).
        extra_layers: int, decoder blocks added on top of the trunk's.
        sequence_length: the preprocessor's packed length.
        dtype: dtype policy.
        **backbone_kwargs: overrides of `Qwen3Backbone` arguments.

    Returns:
        A `keras_hub.models.Qwen3CausalLM`.

    Example:

    ```python
    standard = keras_mhf.models.standard_causal_lm(tokenizer, "tiny", extra_layers=1)
    ```
    """
    backbone = standard_backbone(
        tokenizer.vocabulary_size(), architecture, extra_layers, dtype, **backbone_kwargs
    )
    preprocessor = MultiHashFormerCausalLMPreprocessor(
        tokenizer, sequence_length=sequence_length
    )
    model = Qwen3CausalLM(backbone=backbone, preprocessor=preprocessor)
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        )
    )
    return model
