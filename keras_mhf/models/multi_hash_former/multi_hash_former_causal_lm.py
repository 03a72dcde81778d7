import keras
from keras import ops
from keras_hub.models import CausalLM

from keras_mhf.losses.signature_cross_entropy import SignatureCrossEntropy
from keras_mhf.models import quantization
from keras_mhf.models.causal_lm_inputs import check_score_arguments
from keras_mhf.models.causal_lm_mixin import CausalLMMixin
from keras_mhf.models.multi_hash_former import (
    multi_hash_former_fused_loss as fused_loss,
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
from keras_mhf.models.next_token_scorer import forget_scorers
from keras_mhf.models.next_token_scorer import target_losses
from keras_mhf.models.preset_consistency import check_preset_consistency
from keras_mhf.utils.keras_utils import TASK_KWARGS
from keras_mhf.utils.keras_utils import argument_names
from keras_mhf.utils.keras_utils import check_known_kwargs
from keras_mhf.utils.keras_utils import check_temperature


@keras.saving.register_keras_serializable(package="keras_mhf")
class MultiHashFormerCausalLM(CausalLMMixin, CausalLM):
    """MultiHashFormer causal language model (KerasHub `CausalLM`).

    The functional output is the cascade's bucket logits `[b, s, H, B]`
    (Sec. 3.3), trained by `SignatureCrossEntropy` on the targets'
    signatures (Sec. 3.4, training); by default the fused head computes that
    loss block by block from the hidden states, so neither `[b, s, V]` nor
    `[b, s, H, B]` is formed (`head_block_size`). `generate` and `score` use
    token log-probabilities over the real vocabulary (Sec. 3.4, inference:
    `multi_hash_former_inference`), so every KerasHub sampler works. Build
    with `from_tokenizer`, load with `from_preset` (a KerasHub preset or an
    authors' Hugging Face checkpoint), grow with `expand_vocabulary` (no new
    parameters). Token ids and the tokenizer are checked where they enter.

    Args:
        backbone: a `MultiHashFormerBackbone`.
        preprocessor: a `MultiHashFormerCausalLMPreprocessor` or `None`.
        scoring_temperature: `tau > 0` of `log_softmax_V(s(w) / tau)`; 1.0
            (default) is the paper's rule, `calibrate` fits it.
        decoding: `"candidates"` (default) or `"full"`: how greedy and
            top-k generation find the vocabulary's top tokens; both give
            exactly the same tokens. `"candidates"` searches the tokens of
            each head's top buckets and certifies the answer (falling back
            to the full scan when it cannot); with `candidate_buckets=None`
            it does so only above `CANDIDATE_MIN_VOCABULARY` tokens.
        candidate_buckets: `K`, buckets per head searched; `None` chooses it
            from the table (about 4,096 candidates per row). Setting it
            forces the search at any vocabulary size.
        head_block_size: positions per block of the fused training head
            (`multi_hash_former_fused_loss`): `None` (default) chooses it
            (about 2^24 logits per block) and trains unchunked when the
            compiled loss or metrics need the logits; 0 always trains
            unchunked (the reference); an int > 0 fixes it. With the fused
            head, `call(..., training=True)` returns the final hidden states
            `[b, s, d]`, and the loss never forms `[b, s, H, B]`.
        **kwargs: standard `keras_hub.models.CausalLM` arguments.

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
        check_known_kwargs(
            "MultiHashFormerCausalLM",
            kwargs,
            argument_names(type(self)),
            allowed=TASK_KWARGS,
        )
        candidate_buckets = inference.check_decoding(
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
        lookup = backbone.signature_lookup
        self.bucket_index = inference.BucketIndex(
            lookup.vocabulary_size,
            lookup.num_hashes,
            lookup.num_buckets,
            name="bucket_index",
        )
        self.bucket_index.build()  # filled by `refresh`, before generation
        # tokenization_fingerprint of the last tokenizer that passed.
        self._verified_tokenizer = None
        self._generate_key = None
        # Generation steps and how many of them fell back to the full scan.
        self.decoding_statistics = inference.DecodingStatistics()

        # === Config ===
        self.scoring_temperature = scoring_temperature
        self.decoding = decoding
        self.candidate_buckets = candidate_buckets

    @property
    def scoring_temperature(self):
        """`tau` of `log P(w) = log_softmax_V(s(w) / tau)`, `s(w) = sum_i
        log p_i(h_i(w))`. 1.0 is the paper's inference rule (Sec. 3.4);
        `calibrate` fits it on held-out text. Setting it takes effect in
        `score`, `generate` (every sampler), evaluation and export."""
        return self._scoring_temperature

    @scoring_temperature.setter
    def scoring_temperature(self, value):
        self._scoring_temperature = check_temperature(value)
        self._forget_compiled()

    def _forget_compiled(self):
        """Drops compiled functions that captured the model's settings."""
        self.generate_function = None
        forget_scorers(self)

    def resolved_candidate_buckets(self):
        """`K`, the buckets per head searched by `decoding="candidates"`."""
        lookup = self.backbone.signature_lookup
        self.bucket_index.refresh(lookup)
        return inference.resolved_candidate_buckets(
            self.candidate_buckets, self.bucket_index, lookup.num_buckets
        )

    def has_task_weights(self):
        """Whether weights outside the backbone need saving: the bucket
        index is derived from the table and never saved, so it does not
        count (a preset holds only the backbone's weights)."""
        derived = {id(w) for w in self.bucket_index.weights}
        inside = {id(w) for w in self.backbone.weights} | derived
        return any(id(w) not in inside for w in self.weights)

    # --- Construction -------------------------------------------------------

    @classmethod
    def from_tokenizer(
        cls, tokenizer, architecture="tiny_h4b1024", sequence_length=1024, **kw
    ):
        """A new, randomly initialised model for a `MultiHashFormerTokenizer`:
        the signature table is hashed from its vocabulary (paper Sec. 3.1).

        Args:
            tokenizer: a `MultiHashFormerTokenizer`.
            architecture: a name like `"1b_h4b16k"` or `"tiny_h3b512"` (see
                `keras_mhf.models.architecture_names()`).
            sequence_length: the preprocessor's packed length.
            **kw: `signature_rule` (`"unique"`, `"reference"`,
                `"repeated"`), `dtype`, overrides of any backbone argument
                (e.g. `num_layers=3`) and the task's own arguments.
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
        """Loads a KerasHub preset directory, or converts a Hugging Face
        checkpoint of the authors' code (safetensors only; `kwargs` may give
        `tokenizer`, `dtype`, `sequence_length`). Raises `ValueError` when
        the preset's files disagree, its weights do not fit, or its tokenizer
        does not match the model."""
        from keras_mhf.utils.transformers import convert_multi_hash_former

        if convert_multi_hash_former.is_authors_checkpoint(preset):
            return convert_multi_hash_former.load_authors_checkpoint(
                cls, preset, load_weights=load_weights, **kwargs
            )
        check_preset_consistency(preset)  # before building anything
        model = super().from_preset(preset, load_weights=load_weights, **kwargs)
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
        """`CausalLM.compile` with `SignatureCrossEntropy` as the default loss
        and no default metric (metrics see the targets' signatures)."""
        super().compile(
            optimizer=optimizer,
            loss=SignatureCrossEntropy() if loss == "auto" else loss,
            weighted_metrics=(
                None if weighted_metrics == "auto" else weighted_metrics
            ),
            sampler=sampler,
            **kwargs,
        )
        fused_loss.uses_fused_head(self)  # refuses what it cannot fuse

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """`keras.Model.quantize` (`"int8"`, `"int4"`, `"gptq"`, `"awq"`)
        plus the hash encoder's bucket tables (`keras_mhf.models.quantization`).
        A quantized model is for inference: its optimizer is rebuilt."""
        quantization.quantize_causal_lm(
            self, super().quantize, mode, config, filters, **kwargs
        )
        self._forget_compiled()
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and optimizer.built:
            self.compile(
                optimizer=type(optimizer).from_config(optimizer.get_config()),
                loss=self.loss,
                sampler=self.sampler,
            )

    def get_quantization_layer_structure(self, mode=None):
        """What GPTQ/AWQ calibrate: the encoder, then the blocks in order."""
        return quantization.quantization_layer_structure(self.backbone, mode)

    def _target_signatures(self, y):
        """Token targets `[b, s]` -> their signatures `[b, s, H]`, cached by
        the identity of `y`: Keras calls `compute_loss` then `compute_metrics`
        with the same `y`, and on JAX the latter runs outside the stateless
        scope that holds the variables (the table cannot be read there)."""
        if y is None:
            return None
        cached = getattr(self, "_signature_cache", None)
        if cached is not None and cached[0] is y:
            return cached[1]
        signatures = self.backbone.signature_lookup(y)
        self._signature_cache = (y, signatures)
        return signatures

    def call(self, inputs, training=None, mask=None):
        # Fused training head (Sec. 3.3-3.4): the loss reads the hidden states.
        if training and fused_loss.uses_fused_head(self):
            return self.backbone(inputs, training=training)
        return super().call(inputs, training=training, mask=mask)

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        y = self._target_signatures(y)
        if y_pred is not None and len(y_pred.shape) == 3:  # hidden states
            return fused_loss.fused_compute_loss(self, y, y_pred, sample_weight)
        return super().compute_loss(x, y, y_pred, sample_weight, training)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        signatures = self._target_signatures(y)
        self._signature_cache = None
        return super().compute_metrics(x, signatures, y_pred, sample_weight)

    # --- Inference (paper Sec. 3.4) -------------------------------------------

    def bucket_logits(self, hidden_states):
        """Final hidden states `[..., d]` -> bucket logits `[..., H, B]`."""
        return self.hash_decoder(hidden_states)

    def token_scores(self, hidden_states):
        """Raw token scores `s(w) = sum_i log p_i(h_i(w))` `[..., V]`."""
        log_probs = inference.head_log_probs(self.bucket_logits(hidden_states))
        table = self.backbone.signature_lookup.signatures
        return inference.token_scores(log_probs, table)

    def token_log_probs(self, hidden_states):
        """Token log-probs `[..., V]` (float32):
        `log_softmax_V(s(w) / scoring_temperature)`."""
        log_probs = inference.head_log_probs(self.bucket_logits(hidden_states))
        table = self.backbone.signature_lookup.signatures
        return inference.token_log_probs(
            log_probs, table, self.scoring_temperature
        )

    def next_token_statistics(self, hidden_states, targets, with_argmax=True):
        """`(log p(target), top log-prob, argmax id)` per position, without
        forming `[..., V]` (`inference.vocabulary_statistics`)."""
        log_probs = inference.head_log_probs(self.bucket_logits(hidden_states))
        return inference.vocabulary_statistics(
            log_probs,
            self.backbone.signature_lookup.signatures,
            targets,
            self.scoring_temperature,
            with_argmax=with_argmax,
        )

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """KerasHub's cached forward pass for generation: `(token_log_probs
        [b, s, V], hidden_states [b, s, d], cache)`; `cache` is float
        `[b, num_layers, 2, max_length, num_kv_heads, head_dim]`."""
        hidden_states, cache = self.hidden_states_with_cache(
            token_ids, cache, cache_update_index
        )
        return self.token_log_probs(hidden_states), hidden_states, cache

    def hidden_states_with_cache(self, token_ids, cache, cache_update_index):
        """The trunk alone with a KV cache: `(hidden_states, cache)`."""
        return inference.trunk_with_cache(
            self.backbone, token_ids, cache, cache_update_index
        )

    def _build_cache(self, token_ids):
        """Builds and seeds the KV cache: `(hidden_states, cache)`."""
        cache = inference.empty_cache(
            self.backbone, token_ids, self.compute_dtype
        )
        return self.hidden_states_with_cache(token_ids, cache, 0)

    def generate_step(self, inputs, stop_token_ids=None):
        """One compiled generation call (KerasHub's contract). Greedy and
        top-k samplers choose with the candidate search or the full scan
        (`decoding`); other samplers draw from the full distribution."""
        hidden_states, cache = self._build_cache(inputs["token_ids"])
        k = inference.sampler_top_k(self.sampler)
        if k is None:
            return inference.sampled_generate_step(
                self, inputs, stop_token_ids, hidden_states, cache
            )
        return inference.top_k_generate_step(
            self, inputs, stop_token_ids, cache, k
        )

    def make_generate_function(self):
        """KerasHub's compiled generation function behind a host-side check
        of the prompt's ids; fallbacks are counted in `decoding_statistics`
        (`inference.counted_generate_function`)."""
        version = self.bucket_index.refresh(self.backbone.signature_lookup)
        key = (version, self.decoding, self.candidate_buckets)
        if self.generate_function is None or key != self._generate_key:
            self.generate_function = None
            self.generate_function = inference.counted_generate_function(
                super().make_generate_function(),
                self.backbone.vocabulary_size,
                self.decoding_statistics,
            )
            self._generate_key = key
        return self.generate_function

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
        (`i = -1`) and each block's output."""
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
            hidden_states, target_ids
        )
        return -target_log_probs

    # --- Delegates ------------------------------------------------------------

    def export_to_transformers(
        self, path, overwrite=False, max_position_embeddings=32768
    ):
        """Writes a Hugging Face checkpoint in the authors' format that their
        code and `from_preset(path)` load (atomic; a quantized model or an
        existing `path` without `overwrite` is refused). See
        `keras_mhf.utils.transformers.export_multi_hash_former`."""
        from keras_mhf.utils.transformers import export_multi_hash_former

        return export_multi_hash_former.export_causal_lm(
            self, path, overwrite, max_position_embeddings
        )

    def calibrate(
        self, data, batch_size=8, sequence_length=None, max_tokens=4096
    ):
        """Fits and sets `scoring_temperature` on held-out `data` (a prepared
        data directory, text files, documents or token blocks); returns the
        report. See `keras_mhf.calibration.calibrate`."""
        from keras_mhf.calibration import calibrate

        return calibrate(self, data, batch_size, sequence_length, max_tokens)

    def check_tokenizer(self, force=False):
        """Raises a clear error if the attached tokenizer does not match the
        signature table or tokenizes differently from the model's record
        (`backbone.tokenization_fingerprint`); checked again whenever the
        tokenizer's fingerprint changes, or with `force`."""
        vocabulary.check_task_tokenizer(self, force)

    def expand_vocabulary(self, new_tokens=None, tokenizer=None):
        """A model for a larger vocabulary, with no new parameters (paper
        Sec. 4.4): `new_tokens` (or the expanded `tokenizer`'s new pieces)
        are appended and hashed with the same rule; every trained weight is
        copied. See `multi_hash_former_vocabulary.expand_vocabulary`."""
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
