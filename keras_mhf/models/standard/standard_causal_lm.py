"""The Standard / Standard+kL baseline (paper Sec. 4.1, "Baselines")."""

import keras
from keras_hub.models import Qwen3CausalLM

from keras_mhf.models import generation_stream
from keras_mhf.models.causal_lm_mixin import CausalLMMixin
from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    parse_architecture,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm_preprocessor import (
    MultiHashFormerCausalLMPreprocessor,
)
from keras_mhf.models.standard.standard_backbone import StandardBackbone
from keras_mhf.optimizers import task_default_optimizer
from keras_mhf.utils.concurrent_inference import serialized
from keras_mhf.utils.keras_utils import keep_saved_precision
from keras_mhf.utils.keras_utils import memory_lean


@keras.saving.register_keras_serializable(package="keras_mhf")
class StandardCausalLM(CausalLMMixin, Qwen3CausalLM):
    """KerasHub's `Qwen3CausalLM` on a `StandardBackbone`.

    Generation, scoring and the KV cache are KerasHub's own Qwen3 code, with
    the checked `fit`/`generate`, the SavedModel export and the compile
    config that both tasks share (`CausalLMMixin`); only the backbone (the
    same `Qwen3DecoderBlock` trunk as MultiHashFormer) and the default loss
    differ: a token cross-entropy averaged over unmasked
    positions, like `SignatureCrossEntropy`. Build one with
    `keras_mhf.models.standard_causal_lm(tokenizer, architecture)`.

    Args:
        backbone: a `StandardBackbone`.
        preprocessor: a `MultiHashFormerCausalLMPreprocessor` or `None`.
        **kwargs: standard `keras_hub.models.CausalLM` arguments.

    Example:

    ```python
    from keras_mhf.pretraining import train_sentencepiece

    texts = ["The cell is the basic unit of life."] * 20
    path = train_sentencepiece(texts, 300, "tok.model")  # or your own
    tokenizer = keras_mhf.models.MultiHashFormerTokenizer(path)
    standard = keras_mhf.models.standard_causal_lm(
        tokenizer, "tiny", sequence_length=16
    )
    standard.fit(["The cell is the basic unit of life."] * 8, batch_size=4)
    standard.generate("The cell", max_length=16)
    ```
    """

    backbone_cls = StandardBackbone
    preprocessor_cls = MultiHashFormerCausalLMPreprocessor

    def compile(self, optimizer="auto", loss="auto", **kwargs):
        """Like `CausalLM.compile`, with the default loss averaged over the
        unmasked positions (`reduction="mean_with_sample_weight"`) and the
        default optimizer with epsilon after bias correction
        (`keras_mhf.optimizers.task_default_optimizer`)."""
        optimizer = task_default_optimizer(optimizer)
        default = loss == "auto" and "metrics" not in kwargs
        default = default and kwargs.get("weighted_metrics", "auto") == "auto"
        if loss == "auto":
            loss = keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            )
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        memory_lean(self.optimizer)
        if default:
            self.build_default_objectives(
                keras.KerasTensor((None, None), "int32"),
                keras.KerasTensor(
                    (None, None, self.backbone.vocabulary_size),
                    self.backbone.compute_dtype,
                ),
            )

    def prefill_cache(self, prompt_ids, cache):
        """Seeds an empty KV cache with the prompt's `prompt_ids [b, p]`
        (KerasHub's `call_with_cache`, as its `_build_cache`), for
        streaming."""
        return self.call_with_cache(prompt_ids, cache, 0)[2]

    def decoding_loop(self, sampler, mask, stop_token_ids):
        """The loop KerasHub's Qwen3 `generate_step` runs (the sampler's
        step on `call_with_cache`), for streaming
        (`keras_mhf.models.generation_stream`)."""
        return generation_stream.sampled_loop(
            self, sampler, mask, stop_token_ids
        )

    def token_log_probs(self, hidden_states):
        """Final hidden states `[..., d]` -> token log-probs `[..., V]`
        (float32), as `MultiHashFormerCausalLM.token_log_probs`."""
        logits = self.backbone.token_embedding(hidden_states, reverse=True)
        return keras.ops.log_softmax(keras.ops.cast(logits, "float32"), axis=-1)

    @serialized
    def score(self, *args, **kwargs):
        """KerasHub's `Qwen3CausalLM.score`, safe to call from several
        threads (`keras_mhf.utils.concurrent_inference`)."""
        return super().score(*args, **kwargs)

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """Loads a KerasHub preset directory, or a Hugging Face
        `Qwen3ForCausalLM` checkpoint directory (as `export_to_transformers`
        writes; `tokenizer`, `dtype` and `sequence_length` may be given)."""
        from keras_mhf.export.transformers import convert_multi_hash_former
        from keras_mhf.export.transformers import convert_qwen3

        if convert_multi_hash_former.is_authors_checkpoint(preset):
            raise ValueError(
                f"{preset} is a MultiHashFormer Hugging Face checkpoint, not "
                "the Standard baseline's; load it with "
                "MultiHashFormerCausalLM.from_preset."
            )
        if convert_qwen3.is_qwen3_checkpoint(preset):
            return convert_qwen3.load_qwen3_checkpoint(
                cls, preset, load_weights=load_weights, **kwargs
            )
        kwargs = keep_saved_precision(preset, kwargs)
        return super().from_preset(preset, load_weights=load_weights, **kwargs)


def standard_backbone(
    vocabulary_size,
    architecture="tiny",
    extra_layers=0,
    dtype=None,
    **backbone_kwargs,
):
    """The Standard baseline's `StandardBackbone` for a named trunk (see
    `standard_causal_lm`), for a vocabulary size without a tokenizer (e.g.
    benchmarks)."""
    trunk, _ = parse_architecture(architecture)
    trunk["num_layers"] += int(extra_layers)
    trunk.update(backbone_kwargs)
    return StandardBackbone(
        vocabulary_size=vocabulary_size, dtype=dtype, **trunk
    )


def standard_causal_lm(
    tokenizer,
    architecture="tiny",
    extra_layers=0,
    sequence_length=1024,
    dtype=None,
    **backbone_kwargs,
):
    """The Standard baseline on the same trunk and tokenizer as MHF.

    A vocabulary-sized tied embedding matrix replaces the hash interface;
    everything else (Qwen3 blocks, RoPE theta 1e6, RMSNorm eps 1e-6 on every
    norm including q/k, full attention, N(0, 0.02) initialisation) matches
    `MultiHashFormerBackbone`. `extra_layers=k` gives the paper's
    Standard+kL.

    Args:
        tokenizer: a `MultiHashFormerTokenizer` (shared with the MHF model).
        architecture: a trunk name (`"100m"`, `"1b"`, `"tiny"`, ...) or a full
            MHF name (its hash part is ignored).
        extra_layers: int, decoder blocks added on top of the trunk's.
        sequence_length: the preprocessor's packed length.
        dtype: dtype policy.
        **backbone_kwargs: overrides of `StandardBackbone` arguments.

    Returns:
        A `StandardCausalLM` (a KerasHub `Qwen3CausalLM`).

    Example:

    ```python
    from keras_mhf.pretraining import train_sentencepiece

    texts = ["The quick brown fox jumps."] * 20
    path = train_sentencepiece(texts, 300, "tok.model")  # or your own
    tokenizer = keras_mhf.models.MultiHashFormerTokenizer(path)
    standard = keras_mhf.models.standard_causal_lm(  # Standard+1L
        tokenizer, "tiny", extra_layers=1
    )
    ```
    """
    backbone = standard_backbone(
        tokenizer.vocabulary_size(),
        architecture,
        extra_layers,
        dtype,
        **backbone_kwargs,
    )
    preprocessor = MultiHashFormerCausalLMPreprocessor(
        tokenizer, sequence_length=sequence_length
    )
    return StandardCausalLM(backbone=backbone, preprocessor=preprocessor)
