"""The MultiHashFormer task (KerasHub `CausalLM`): training, generation and
scoring over the vocabulary of a `MultiHashFormerBackbone`."""

import contextlib

import keras
from keras import ops
from keras_hub.models import CausalLM

from keras_mhf.losses import fused_signature_loss as fused_loss
from keras_mhf.losses.signature_cross_entropy import SignatureCrossEntropy
from keras_mhf.models import generation_stream
from keras_mhf.models.causal_lm_inputs import check_score_arguments
from keras_mhf.models.causal_lm_mixin import CausalLMMixin
from keras_mhf.models.multi_hash_former import (
    multi_hash_former_bucket_index as bucket_index,
)
from keras_mhf.models.multi_hash_former import (
    multi_hash_former_decoding as generation,
)
from keras_mhf.models.multi_hash_former import (
    multi_hash_former_inference as inference,
)
from keras_mhf.models.multi_hash_former import (
    multi_hash_former_vocabulary as vocabulary,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_backbone import (
    MultiHashFormerBackbone,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_causal_lm_preprocessor import (
    MultiHashFormerCausalLMPreprocessor,
)
from keras_mhf.models.next_token_scorer import target_losses
from keras_mhf.models.preset_consistency import check_preset_consistency
from keras_mhf.models.preset_consistency import task_settings_given
from keras_mhf.models.quantization import TableQuantizationMixin
from keras_mhf.optimizers import task_default_optimizer
from keras_mhf.utils import keras_utils
from keras_mhf.utils.concurrent_inference import serialized


@keras.saving.register_keras_serializable(package="keras_mhf")
class MultiHashFormerCausalLM(TableQuantizationMixin, CausalLMMixin, CausalLM):
    """MultiHashFormer causal language model (KerasHub `CausalLM`).

    The functional output is the cascade's bucket logits `[b, s, H, B]`
    (Sec. 3.3), trained by `SignatureCrossEntropy` on the targets'
    signatures (Sec. 3.4); the fused head computes that loss block by block
    from the hidden states (`head_block_size`). `generate` and `score` use
    token log-probs over the real vocabulary (Sec. 3.4, inference:
    `multi_hash_former_inference`), so every KerasHub sampler works.

    Args:
        backbone: a `MultiHashFormerBackbone`.
        preprocessor: a `MultiHashFormerCausalLMPreprocessor` or `None`.
        scoring_temperature: `tau > 0` of `log_softmax_V(s(w) / tau)`; 1.0
            is the paper's rule; `keras_mhf.evaluation.calibrate` fits it.
        decoding: `"candidates"` (default: the certified search of the
            heads' top buckets, with `candidate_buckets=None` only above
            `CANDIDATE_MIN_VOCABULARY` tokens) or `"full"` (the scan): how
            greedy and top-k generation find the top tokens; same tokens.
        candidate_buckets: `K`, buckets per head searched; `None` chooses it
            (about 4,096 candidates per row); an int forces the search.
        head_block_size: positions per block of the fused training head:
            `None` chooses it for the device (`automatic_block_size`:
            about 2^24 logits per block on a CPU, more on an
            accelerator), 0 trains unchunked (the reference), an int > 0
            fixes it. With the fused head, `call(..., training=True)`
            returns the hidden states (see `call_output`).
        **kwargs: standard `keras_hub.models.CausalLM` arguments.

    Attributes:
        call_output: what the last `call` returned, so that `compute_loss`
            knows what its `y_pred` is: `"bucket_logits"` (the functional
            output `[b, s, H, B]`: inference, and training with the
            unchunked head) or `"hidden_states"` (the final hidden states
            `[b, s, d]`: a training call with the fused head, whose loss
            `compute_loss` computes from them). Decided at call time by
            `keras_mhf.losses.fused_signature_loss.call_output`
            (`uses_fused_head`).
        step_signatures: the targets' signatures `[b, s, H]` of the step in
            progress, looked up by `compute_loss` and taken by
            `compute_metrics` (a
            `keras_mhf.losses.fused_signature_loss.StepSignatures`: Keras'
            train and test steps pass nothing else between the two).
        verified_tokenizer: the `tokenization_fingerprint` of the last
            tokenizer `check_tokenizer` passed (`None`: none yet).
        decoding_statistics: generation steps, and how many of them fell
            back to the full scan (`DecodingStatistics`).

    Example:

    ```python
    tokens = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    lm = keras_mhf.models.MultiHashFormerCausalLM.from_tokens(
        tokens, architecture="tiny_h4b1024", pad_token_id=0
    )
    lm.compile(optimizer=keras.optimizers.AdamW(1e-3))
    ids = np.random.randint(3, 64, (4, 16))
    lm.fit({"token_ids": ids[:, :-1], "padding_mask": ids[:, :-1] > 0},
           ids[:, 1:], batch_size=2)
    lm.score(ids)  # token log-probs [4, 16, 64]
    ```
    """

    backbone_cls = MultiHashFormerBackbone
    preprocessor_cls = MultiHashFormerCausalLMPreprocessor

    def __init__(
        self,
        backbone,
        preprocessor=None,
        scoring_temperature=1.0,
        decoding="candidates",
        candidate_buckets=None,
        head_block_size=None,
        **kwargs,
    ):
        keras_utils.check_known_kwargs(
            "MultiHashFormerCausalLM",
            kwargs,
            keras_utils.argument_names(type(self)),
            allowed=keras_utils.TASK_KWARGS,
        )
        candidate_buckets = generation.check_decoding(
            decoding, candidate_buckets
        )
        # === Layers ===
        self.head_block_size = fused_loss.check_block_size(head_block_size)
        self.backbone = backbone
        self.preprocessor = preprocessor
        self.hash_decoder = backbone.hash_decoder

        # === Functional Model ===
        inputs = backbone.input
        outputs = self.hash_decoder(backbone(inputs))
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)

        # === Inference state (derived, never saved) ===
        self.bucket_index = bucket_index.BucketIndex.for_lookup(
            backbone.signature_lookup, name="bucket_index"
        )
        self.verified_tokenizer = None
        self.decoding_statistics = generation.DecodingStatistics()

        # === Training step state (see the class docstring) ===
        self.call_output = fused_loss.BUCKET_LOGITS
        self.step_signatures = fused_loss.StepSignatures()

        # === Config ===
        self.scoring_temperature = scoring_temperature
        self.decoding = decoding
        self.candidate_buckets = candidate_buckets

    @property
    def scoring_temperature(self):
        """`tau` of `log P(w) = log_softmax_V(s(w) / tau)`, `s(w) = sum_i
        log p_i(h_i(w))` (Sec. 3.4: 1.0 is the paper's rule); used by
        `score`, `generate`, evaluation and export."""
        return self._scoring_temperature

    @scoring_temperature.setter
    def scoring_temperature(self, value):
        self._scoring_temperature = keras_utils.check_temperature(value)
        # Compiled scorers take the temperature as an input; only
        # generation holds it.
        self.generate_function = None

    def has_task_weights(self):
        """Whether weights outside the backbone need saving (the derived
        bucket index does not count: a preset holds the backbone's)."""
        return bucket_index.has_task_weights(self)

    # --- Construction -------------------------------------------------------

    @classmethod
    def from_tokenizer(
        cls, tokenizer, architecture="tiny_h4b1024", sequence_length=1024, **kw
    ):
        """A new, randomly initialised model for a `MultiHashFormerTokenizer`
        (its signature table hashed from the vocabulary, paper Sec. 3.1), of
        a named `architecture` (`keras_mhf.models.architecture_names()`).
        `kw`: `signature_rule` (`"unique"`, `"reference"`, `"repeated"`),
        `dtype`, backbone overrides (`num_layers=3`), the task's arguments.
        """
        return vocabulary.causal_lm_from_tokenizer(
            cls, tokenizer, architecture, sequence_length, **kw
        )

    @classmethod
    def from_tokens(cls, tokens, architecture="tiny_h4b1024", **kw):
        """A new model without a preprocessor from token strings (token id =
        position), e.g. for benchmarks on synthetic vocabularies; `kw` as
        `from_tokenizer`, plus `pad_token_id` (the all-zero signature)."""
        return vocabulary.causal_lm_from_tokens(cls, tokens, architecture, **kw)

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """Loads a KerasHub preset, or converts the authors' Hugging Face
        checkpoint (`kwargs`: `tokenizer`, `dtype`, `sequence_length`);
        `ValueError` when its files disagree, its weights do not fit, its
        tokenizer does not match the model, or its `task.json` is missing
        (unless `scoring_temperature=` is passed: the task's setting, chosen
        explicitly)."""
        from keras_mhf.export.transformers import convert_multi_hash_former

        if convert_multi_hash_former.is_authors_checkpoint(preset):
            return convert_multi_hash_former.load_authors_checkpoint(
                cls, preset, load_weights=load_weights, **kwargs
            )
        kwargs = keras_utils.keep_saved_precision(preset, kwargs)
        chosen = "scoring_temperature" in kwargs  # the task's setting
        with task_settings_given() if chosen else contextlib.nullcontext():
            check_preset_consistency(preset)  # before building anything
            model = super().from_preset(
                preset, load_weights=load_weights, **kwargs
            )
        if load_weights:
            model.check_tokenizer()
        return model

    # --- Training -----------------------------------------------------------

    def compile(
        self,
        optimizer="auto",
        loss="auto",
        *,
        weighted_metrics="auto",
        sampler="top_k",
        **kwargs,
    ):
        """`CausalLM.compile` with `SignatureCrossEntropy` as the default loss,
        no default metric (metrics see the targets' signatures) and, for
        `"auto"`, KerasHub's default optimizer (Adam, 2e-5) with epsilon
        after bias correction as torch (`BiasCorrectedAdamW`, no decay)."""
        super().compile(
            optimizer=task_default_optimizer(optimizer),
            loss=SignatureCrossEntropy() if loss == "auto" else loss,
            weighted_metrics=(
                None if weighted_metrics == "auto" else weighted_metrics
            ),
            sampler=sampler,
            **kwargs,
        )
        keras_utils.memory_lean(self.optimizer)
        fused_loss.uses_fused_head(self)  # refuses what it cannot fuse
        defaults = (loss, weighted_metrics, kwargs.get("metrics", "auto"))
        if defaults == ("auto",) * 3:
            self.build_default_objectives(
                *fused_loss.objective_shapes(self.hash_decoder)
            )

    def call(self, inputs, training=None, mask=None):
        """The bucket logits, or, in a training call with the fused head
        (Sec. 3.3-3.4), the final hidden states that its loss reads;
        records which in `call_output`."""
        self.call_output = fused_loss.call_output(self, training)
        if self.call_output == fused_loss.HIDDEN_STATES:
            return self.backbone(inputs, training=training)
        return super().call(inputs, training=training, mask=mask)

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        """`SignatureCrossEntropy` of the token targets `y`, mapped to their
        signatures (kept in `step_signatures` for `compute_metrics`): the
        fused head's when `call_output` says `y_pred` is hidden states,
        Keras' compiled loss on the bucket logits otherwise."""
        signatures = self.step_signatures.look_up(self, y)
        if y_pred is not None and self.call_output == fused_loss.HIDDEN_STATES:
            return fused_loss.fused_compute_loss(
                self, signatures, y_pred, sample_weight
            )
        return super().compute_loss(
            x, signatures, y_pred, sample_weight, training
        )

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        """Keras' compiled metrics on the signatures that `compute_loss`
        recorded for the same targets `y` (`step_signatures`)."""
        signatures = self.step_signatures.take(self, y)
        return super().compute_metrics(x, signatures, y_pred, sample_weight)

    # --- Inference (paper Sec. 3.4) -------------------------------------------

    def token_scores(self, hidden_states):
        """Raw token scores `s(w) = sum_i log p_i(h_i(w))` `[..., V]`."""
        return inference.token_scores(*inference.heads(self, hidden_states))

    def token_log_probs(self, hidden_states):
        """Token log-probs `[..., V]` (float32):
        `log_softmax_V(s(w) / scoring_temperature)`."""
        return inference.token_log_probs(
            *inference.heads(self, hidden_states), self.scoring_temperature
        )

    def next_token_statistics(
        self, hidden_states, targets, with_argmax=True, temperature=None
    ):
        """`(log p(target), top log-prob, argmax id)` per position, never
        forming `[..., V]`, at `temperature` (default: the model's
        `scoring_temperature`); see `inference.next_token_statistics`."""
        return inference.next_token_statistics(
            self, hidden_states, targets, with_argmax, temperature
        )

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """KerasHub's cached forward pass: `(token_log_probs [b, s, V],
        hidden_states, cache)`, `cache` `[b, layers, 2, max_length, kv, hd]`."""
        hidden_states, cache = generation.trunk_with_cache(
            self.backbone, token_ids, cache, cache_update_index
        )
        return self.token_log_probs(hidden_states), hidden_states, cache

    def _build_cache(self, token_ids):
        """Builds and seeds the KV cache: `(hidden_states, cache)`."""
        cache = generation_stream.empty_cache(
            self.backbone, token_ids, self.compute_dtype
        )
        return generation.trunk_with_cache(self.backbone, token_ids, cache, 0)

    def generate_step(self, inputs, stop_token_ids=None):
        """One compiled generation call (KerasHub's contract): greedy and
        top-k by `decoding`, other samplers from the full distribution."""
        hidden_states, cache = self._build_cache(inputs["token_ids"])
        k = generation.sampler_top_k(self.sampler)
        if k is None:
            return generation.sampled_generate_step(
                self, inputs, stop_token_ids, hidden_states, cache
            )
        return generation.top_k_generate_step(
            self, inputs, stop_token_ids, cache, k
        )

    def prefill_cache(self, prompt_ids, cache):
        """Seeds an empty KV cache with the prompt's `prompt_ids [b, p]`
        (the trunk only: no token scores), for streaming."""
        return generation.trunk_with_cache(self.backbone, prompt_ids, cache, 0)[
            1
        ]

    def decoding_loop(self, sampler, mask, stop_token_ids):
        """The loop `generate_step` runs, for streaming
        (`keras_mhf.models.generation_stream`): MultiHashFormer's top-k step
        for greedy and top-k samplers, KerasHub's sampler step otherwise."""
        k = generation.sampler_top_k(sampler)
        if k is None:
            return generation_stream.sampled_loop(
                self, sampler, mask, stop_token_ids
            )
        cond, body, initial = generation.top_k_loop(
            self, sampler, mask, stop_token_ids, k
        )
        return generation_stream.DecodingLoop(
            cond, body, initial, self.decoding_statistics
        )

    def make_generate_function(self):
        """KerasHub's compiled generation, checking the prompt's ids and
        counting fallbacks in `decoding_statistics`."""
        return generation.cached_generate_function(
            self, super().make_generate_function
        )

    @serialized
    def score(
        self,
        token_ids,
        padding_mask=None,
        scoring_mode="logits",
        layer_intercept_fn=None,
        target_ids=None,
    ):
        """KerasHub's `CausalLM.score`: `"logits"` gives token log-probs over
        the real vocabulary `[b, s, V]` (float32, normalised); `"loss"` the
        per-token negative log-likelihood of `target_ids` `[b, s]`, without
        forming `[b, s, V]`. `layer_intercept_fn(x, i)` sees the embeddings
        (`i = -1`) and each block's output. Safe to call from several
        threads (`keras_mhf.utils.concurrent_inference`)."""
        self.check_tokenizer()
        padding_mask = check_score_arguments(
            self, token_ids, padding_mask, scoring_mode, target_ids
        )
        if scoring_mode == "loss" and layer_intercept_fn is None:
            # Compiled once per model and shape.
            return ops.convert_to_tensor(
                target_losses(self, token_ids, padding_mask, target_ids)
            )
        hidden_states = inference.trunk(
            self.backbone, token_ids, padding_mask, layer_intercept_fn
        )
        if scoring_mode == "logits":
            return self.token_log_probs(hidden_states)
        target_log_probs, _, _ = self.next_token_statistics(
            hidden_states, target_ids, with_argmax=False
        )
        return -target_log_probs

    # --- Delegates ------------------------------------------------------------

    def check_tokenizer(self, force=False):
        """Raises a clear error if the attached tokenizer does not match the
        signature table or the model's `tokenization_fingerprint` (checked
        again when the tokenizer's fingerprint changes, or with `force`)."""
        vocabulary.check_task_tokenizer(self, force)

    def expand_vocabulary(self, new_tokens=None, tokenizer=None):
        """A model for a larger vocabulary with no new parameters (Sec. 4.4):
        `new_tokens` (or the expanded `tokenizer`'s new pieces) are hashed
        with the same rule, every weight copied (`vocabulary`)."""
        return vocabulary.expand_vocabulary(self, new_tokens, tokenizer)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "scoring_temperature": self.scoring_temperature,
                "decoding": self.decoding,
                "candidate_buckets": self.candidate_buckets,
                "head_block_size": self.head_block_size,
            }
        )
        return config
