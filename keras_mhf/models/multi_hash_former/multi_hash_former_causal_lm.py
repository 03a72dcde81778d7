import keras
import keras_hub
from keras import ops
from keras_hub.models import CausalLM
from keras_hub.models import Qwen3CausalLM

from keras_mhf.losses.signature_cross_entropy import SignatureCrossEntropy
from keras_mhf.models import causal_lm_inputs
from keras_mhf.models.multi_hash_former import (
    multi_hash_former_inference as decoding_lib,
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
from keras_mhf.models.preset_consistency import check_preset_consistency
from keras_mhf.utils.keras_utils import TASK_KWARGS
from keras_mhf.utils.keras_utils import argument_names
from keras_mhf.utils.keras_utils import check_known_kwargs
from keras_mhf.utils.keras_utils import check_positive_ints
from keras_mhf.utils.keras_utils import check_temperature
from keras_mhf.utils.keras_utils import text_fit
from keras_mhf.utils.token_ids import check_token_ids

DECODINGS = ("candidates", "full")


def _skip_preprocessing(preprocessor, filters):
    """`Model.quantize` filters that leave the preprocessing layers alone
    (they hold no weights, and Keras refuses a reloaded tokenizer, which is
    never "built")."""
    from keras.src.quantizers.utils import should_quantize_layer

    skipped = set()
    if preprocessor is not None:
        skipped = {id(layer) for layer in preprocessor._flatten_layers()}

    def keep(layer):
        return id(layer) not in skipped and should_quantize_layer(
            layer, filters
        )

    return keep


@keras.saving.register_keras_serializable(package="keras_mhf")
class MultiHashFormerCausalLM(CausalLM):
    """MultiHashFormer causal language model (KerasHub `CausalLM`).

    The functional output is the cascade's bucket logits `[b, s, H, B]`
    (paper Sec. 3.3), and `fit` trains them with `SignatureCrossEntropy`
    (Sec. 3.4, training): targets are mapped to signatures inside the model,
    so a `[b, s, V]` tensor is never formed during training. `generate()` and
    `score()` use token log-probabilities over the real vocabulary
    (Sec. 3.4, inference), so every KerasHub sampler works unchanged.

    Build a new model with `from_tokenizer`, load one with `from_preset` (a
    KerasHub preset directory or a Hugging Face checkpoint of the authors'
    code), and grow the vocabulary with `expand_vocabulary` (no new
    parameters). Token ids are validated where they enter (`fit`, `generate`,
    `score`), and the attached tokenizer is checked against the signature
    table whenever it changes.

    Args:
        backbone: a `MultiHashFormerBackbone`.
        preprocessor: a `MultiHashFormerCausalLMPreprocessor` or `None`.
        scoring_temperature: `tau > 0` of `log_softmax_V(s(w) / tau)`; 1.0
            (default) is the paper's rule, `calibrate` fits it.
        decoding: `"candidates"` (default) or `"full"`: how greedy and
            top-k generation find the vocabulary's top tokens. Both give
            exactly the same tokens. `"candidates"` searches the tokens of
            each head's top buckets and certifies the answer (falling back to
            the full scan when it cannot); with `candidate_buckets=None` it
            scans the whole vocabulary when that is cheaper, i.e. for
            vocabularies of at most `CANDIDATE_MIN_VOCABULARY` (262,144)
            tokens (measured crossover on CPU: the search was slower at 131K
            tokens and twice as fast at 1M).
        candidate_buckets: `K`, buckets per head searched; `None` chooses it
            from the table (about 4,096 candidates per row). Setting it
            forces the search at any vocabulary size.
        **kwargs: standard `keras_hub.models.CausalLM` arguments.

    Example:

    ```python
    tokenizer = keras_mhf.models.MultiHashFormerTokenizer(
        "../shared/data/mistral_v03_tokenizer/tokenizer.model"
    )
    lm = keras_mhf.models.MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, architecture="tiny_h4b1024", sequence_length=64
    )
    lm.compile(optimizer=keras.optimizers.AdamW(1e-3))
    lm.fit(["The cell is the basic unit of life."] * 8, batch_size=4)
    lm.generate("The cell", max_length=16)
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
        **kwargs,
    ):
        check_known_kwargs(
            "MultiHashFormerCausalLM",
            kwargs,
            argument_names(type(self)),
            allowed=TASK_KWARGS,
        )
        # === Layers ===
        self.backbone = backbone
        self.preprocessor = preprocessor
        self.hash_decoder = backbone.hash_decoder

        # === Functional Model ===
        inputs = backbone.input
        hidden_states = backbone(inputs)
        outputs = self.hash_decoder(hidden_states)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        # tokenization_fingerprint of the last tokenizer that passed.
        self._verified_tokenizer = None

        # === Config ===
        self.scoring_temperature = scoring_temperature
        if decoding not in DECODINGS:
            raise ValueError(
                f"decoding must be one of {DECODINGS}; got {decoding!r}."
            )
        if candidate_buckets is not None:
            check_positive_ints(
                "MultiHashFormerCausalLM", candidate_buckets=candidate_buckets
            )
            candidate_buckets = int(candidate_buckets)
        self.decoding = decoding
        self.candidate_buckets = candidate_buckets
        self._generate_key = None
        # Generation steps and how many of them fell back to the full scan.
        self.decoding_statistics = decoding_lib.DecodingStatistics()

    def resolved_candidate_buckets(self):
        """`K`, the buckets per head searched by `decoding="candidates"`:
        `candidate_buckets`, or chosen from the table (`B` and the bucket
        loads, i.e. `V / B`) to keep about 4096 candidates per row."""
        lookup = self.backbone.signature_lookup
        buckets = self.candidate_buckets
        if buckets is None:
            buckets = decoding_lib.automatic_candidate_buckets(
                lookup.max_bucket_load
            )
        return min(buckets, lookup.num_buckets - 1)

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
        # Compiled functions captured the old value.
        self.generate_function = None
        from keras_mhf.next_token_scorer import forget_scorers

        forget_scorers(self)

    # --- Construction -------------------------------------------------------

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer,
        architecture="tiny_h4b1024",
        sequence_length=1024,
        signature_rule="unique",
        dtype=None,
        **backbone_kwargs,
    ):
        """Builds a new, randomly initialised model for `tokenizer`.

        The signature table is computed from the tokenizer's vocabulary
        strings (paper Sec. 3.1).

        Args:
            tokenizer: a `MultiHashFormerTokenizer`.
            architecture: a name like `"1b_h4b16k"` or `"tiny_h3b512"` (see
                `keras_mhf.models.architecture_names()`).
            sequence_length: the preprocessor's packed length.
            signature_rule: `"unique"`, `"reference"` or `"repeated"`.
            dtype: dtype policy of the model.
            **backbone_kwargs: overrides of any backbone argument (e.g.
                `num_layers=3`, `num_buckets=2048`), and the task's own
                settings (`scoring_temperature`, `decoding`,
                `candidate_buckets`).
        """
        # The model records how its tokenizer tokenizes (check_tokenizer).
        fingerprint = vocabulary.tokenization_fingerprint(tokenizer)
        backbone_kwargs.setdefault("tokenization_fingerprint", fingerprint)
        model = cls.from_tokens(
            tokenizer.get_vocabulary(),
            architecture,
            pad_token_id=tokenizer.signature_pad_token_id,
            signature_rule=signature_rule,
            dtype=dtype,
            **backbone_kwargs,
        )
        model.preprocessor = cls.preprocessor_cls(
            tokenizer, sequence_length=sequence_length
        )
        # The table was just hashed from this tokenizer's vocabulary.
        model._verified_tokenizer = fingerprint
        return model

    @classmethod
    def from_tokens(
        cls,
        tokens,
        architecture="tiny_h4b1024",
        pad_token_id=None,
        signature_rule="unique",
        dtype=None,
        **backbone_kwargs,
    ):
        """Builds a new model without a preprocessor from token strings
        (token id = position), e.g. for benchmarks on synthetic vocabularies.
        Arguments as `from_tokenizer`; `pad_token_id` gets the all-zero
        signature."""
        task_names = set(argument_names(cls)) - {"backbone", "preprocessor"}
        task_kwargs = {
            key: backbone_kwargs.pop(key)
            for key in list(backbone_kwargs)
            if key in task_names
        }
        backbone = vocabulary.build_backbone(
            cls.backbone_cls,
            tokens,
            architecture,
            pad_token_id=pad_token_id,
            signature_rule=signature_rule,
            dtype=dtype,
            **backbone_kwargs,
        )
        return cls(backbone=backbone, preprocessor=None, **task_kwargs)

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """Loads a KerasHub preset directory, or converts a Hugging Face
        checkpoint directory of the authors' code (safetensors only).

        Args:
            preset: a local directory.
            load_weights: whether to load the weights.
            **kwargs: forwarded to KerasHub's loader (e.g. `dtype`), or, for
                an authors' checkpoint, `tokenizer` (a tokenizer or `.model`
                path), `dtype` and `sequence_length`.

        Raises:
            ValueError: the preset's files disagree (e.g. `config.json` and
                `task.json` describe different backbones; see
                `keras_mhf.models.preset_consistency`), its weights do not
                fit, or its tokenizer does not match the model.
        """
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
        """Like `CausalLM.compile`, with `SignatureCrossEntropy` as the
        default loss and no default metric (bucket-level metrics see the
        targets' signatures `[b, s, H]`)."""
        if loss == "auto":
            loss = SignatureCrossEntropy()
        if weighted_metrics == "auto":
            weighted_metrics = None
        super().compile(
            optimizer=optimizer,
            loss=loss,
            weighted_metrics=weighted_metrics,
            sampler=sampler,
            **kwargs,
        )

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """`keras.Model.quantize` (`"int8"`, `"int4"`) over every Dense
        layer, plus the hash encoder's bucket tables, which the encoder's
        lookup and the decoder's tied logits and soft retrieval read in the
        int dtype (`HashEncoder.quantize`)."""
        super().quantize(
            mode,
            config=config,
            filters=_skip_preprocessing(self.preprocessor, filters),
            **kwargs,
        )
        self.backbone.quantize_hash_tables(mode, config=config, filters=filters)
        self.generate_function = None
        from keras_mhf.next_token_scorer import forget_scorers

        forget_scorers(self)
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and optimizer.built:
            # A quantized model is for inference: its old optimizer state
            # no longer matches the (now partly int) weights.
            self.compile(
                optimizer=type(optimizer).from_config(optimizer.get_config()),
                loss=self.loss,
                sampler=self.sampler,
            )

    def get_compile_config(self):
        """Keras' compile config plus the sampler, so `.keras` loading
        restores the compile state (and the optimizer's variables) instead
        of warning and recompiling with defaults."""
        # Not `super()`: StandardCausalLM shares this method.
        config = keras.Model.get_compile_config(self)
        if config and getattr(self, "sampler", None) is not None:
            config["sampler"] = keras_hub.samplers.serialize(self.sampler)
        if config and getattr(self, "optimizer", None) is not None:
            # Build the restored optimizer only if this one was built, so its
            # saved variables (none, or all of them) load without a warning.
            config["optimizer_built"] = bool(self.optimizer.built)
        return config

    def compile_from_config(self, config):
        """Recompiles from `get_compile_config` (used by `.keras` loading)."""
        config = dict(config)
        sampler = config.pop("sampler", "top_k")
        optimizer_built = config.pop("optimizer_built", True)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(sampler=keras_hub.samplers.get(sampler), **config)
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and optimizer_built and self.built:
            optimizer.build(self.trainable_variables)

    def _target_signatures(self, y):
        """Token targets `[b, s]` -> their signatures `[b, s, H]`.

        The loss and the metrics see signatures, not token ids. Keras calls
        `compute_loss` and then `compute_metrics` with the same `y` object
        in one train or test step; on JAX `compute_metrics` runs outside the
        stateless scope that holds the variables' values (so the signature
        table cannot be read there), hence `compute_loss` caches the
        signatures it computed, keyed by the identity of `y`, and
        `compute_metrics` takes them from the cache and clears it.
        """
        if y is None:
            return None
        cached = getattr(self, "_signature_cache", None)
        if cached is not None and cached[0] is y:
            return cached[1]
        signatures = self.backbone.signature_lookup(y)
        self._signature_cache = (y, signatures)
        return signatures

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        return super().compute_loss(
            x=x,
            y=self._target_signatures(y),
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=training,
        )

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        signatures = self._target_signatures(y)
        self._signature_cache = None
        return super().compute_metrics(
            x, signatures, y_pred, sample_weight=sample_weight
        )

    def fit(self, x=None, y=None, *args, **kwargs):
        """`keras.Model.fit`, after checking the tokenizer and the data
        (`keras_mhf.models.causal_lm_inputs.checked_fit_inputs`) before any
        state changes: with a preprocessor, `x` must be strings (an empty
        list, a non-string entry or a dict is refused with one clear error);
        without one, every token id must be in the vocabulary (streamed
        datasets are checked batch by batch, the first one before training
        starts).

        Example:

        ```python
        lm.fit(["The cell is the basic unit of life."] * 8, batch_size=4)
        ```
        """
        self.check_tokenizer()
        x = causal_lm_inputs.checked_fit_inputs(self, x, y)
        with text_fit(x, args, kwargs):  # KerasHub's text batching, quietly
            return super().fit(x, y, *args, **kwargs)

    # --- Inference ----------------------------------------------------------

    def bucket_logits(self, hidden_states):
        """Final hidden states `[..., d]` -> bucket logits `[..., H, B]`."""
        return self.hash_decoder(hidden_states)

    def token_scores(self, hidden_states):
        """Final hidden states `[..., d]` -> the raw token scores `s(w) =
        sum_i log p_i(h_i(w))` `[..., V]` (float32, not normalised over the
        vocabulary; paper Sec. 3.4)."""
        return self.backbone.signature_lookup.token_log_probs(
            self.bucket_logits(hidden_states), normalize=False
        )

    def token_log_probs(self, hidden_states):
        """Final hidden states `[..., d]` -> token log-probs `[..., V]`
        (float32): `log_softmax_V(s(w) / scoring_temperature)`."""
        scores = self.token_scores(hidden_states)
        if self.scoring_temperature != 1.0:  # 1.0: exactly the paper's rule
            scores = scores / self.scoring_temperature
        return ops.log_softmax(scores, axis=-1)

    def next_token_statistics(self, hidden_states, targets, with_argmax=True):
        """`(log p(target), top log-prob, argmax id)` per position, each
        `[...]`, for hidden states `[..., d]` and target ids `[...]`, without
        forming `[..., V]` (`SignatureLookup.token_statistics`); used by
        `score(scoring_mode="loss")` and evaluation. `with_argmax=False`
        skips tracking the argmax (returned as -1), which `score` does not
        need."""
        return self.backbone.signature_lookup.token_statistics(
            self.bucket_logits(hidden_states),
            targets,
            self.scoring_temperature,
            with_argmax=with_argmax,
        )

    def _trunk_with_cache(self, token_ids, cache, cache_update_index):
        x = self.backbone.embed(token_ids)
        updated_cache = []
        for i in range(self.backbone.num_layers):
            x, next_cache = self.backbone.transformer_layers[i](
                x,
                self_attention_cache=cache[:, i, ...],
                self_attention_cache_update_index=cache_update_index,
            )
            updated_cache.append(next_cache)
        cache = ops.stack(updated_cache, axis=1)
        return self.backbone.layer_norm(x), cache

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """Forward pass with a KV cache, for generation.

        Args:
            token_ids: int `[b, s]`.
            cache: float
                `[b, num_layers, 2, max_length, num_kv_heads, head_dim]`.
            cache_update_index: int, position of `token_ids[:, 0]`.

        Returns:
            `(token_log_probs [b, s, V], hidden_states [b, s, d], cache)`.
        """
        hidden_states, cache = self._trunk_with_cache(
            token_ids, cache, cache_update_index
        )
        return self.token_log_probs(hidden_states), hidden_states, cache

    def _build_cache(self, token_ids):
        """Builds and seeds the KV cache (the trunk only: the prompt's token
        log-probs are not needed)."""
        batch_size, max_length = (
            ops.shape(token_ids)[0],
            ops.shape(token_ids)[1],
        )
        shape = [
            batch_size,
            self.backbone.num_layers,
            2,
            max_length,
            self.backbone.num_key_value_heads,
            self.backbone.head_dim,
        ]
        cache = ops.zeros(shape, dtype=self.compute_dtype)
        hidden_states, cache = self._trunk_with_cache(token_ids, cache, 0)
        return hidden_states, cache

    def generate_step(self, inputs, stop_token_ids=None):
        """One compiled generation call (KerasHub's `CausalLM` contract).

        Greedy and top-k samplers pick tokens with
        `keras_mhf.models.multi_hash_former.multi_hash_former_inference` (the bucket-candidate
        search when `decoding="candidates"`, exact; the full scan when
        `"full"`); every other sampler runs KerasHub's own loop on the full
        distribution, as for KerasHub's Qwen3 (the loop only calls
        `_build_cache`, `call_with_cache` and the sampler).
        """
        k = decoding_lib.sampler_top_k(self.sampler)
        if k is None:
            return Qwen3CausalLM.generate_step(self, inputs, stop_token_ids)
        return decoding_lib.generate_step(self, inputs, stop_token_ids, k)

    def make_generate_function(self):
        """KerasHub's compiled generation function, behind a host-side check
        of the prompt's token ids (once per call, not per generated token);
        counts of candidate-search fallbacks go to `decoding_statistics`."""
        lookup = self.backbone.signature_lookup
        key = (lookup.index_version, self.decoding, self.candidate_buckets)
        if self.generate_function is not None and key == self._generate_key:
            return self.generate_function
        self.generate_function = None
        compiled = super().make_generate_function()
        vocabulary_size = self.backbone.vocabulary_size
        statistics = self.decoding_statistics

        def generate_function(inputs, stop_token_ids=None):
            check_token_ids(inputs["token_ids"], vocabulary_size)
            outputs = dict(compiled(inputs, stop_token_ids))
            fallbacks = outputs.pop("candidate_fallbacks", None)
            steps = outputs.pop("decoding_steps", None)
            if steps is not None:
                statistics.steps += int(ops.convert_to_numpy(steps))
                statistics.fallbacks += int(ops.convert_to_numpy(fallbacks))
            return outputs

        self.generate_function = generate_function
        self._generate_key = key
        return generate_function

    def generate(
        self,
        inputs,
        max_length=None,
        stop_token_ids="auto",
        strip_prompt=False,
        *,
        max_new_tokens=None,
        truncate=None,
    ):
        """KerasHub's `generate` with checked lengths (after checking the
        tokenizer); see `keras_mhf.models.causal_lm_inputs.generate`.

        Args:
            inputs: strings (with a preprocessor) or token ids
                `{"token_ids", "padding_mask"}`, or a `tf.data.Dataset`.
            max_length: the total length (prompt, start token included, and
                new tokens); no prompt may be longer, and not all may fill
                it. Default: the preprocessor's `sequence_length` (token
                ids: their width).
            stop_token_ids: `"auto"`, `None` or a tuple of ids.
            strip_prompt: return only the generated part.
            max_new_tokens: instead of `max_length`: at most this many new
                tokens per prompt; total length (and KV cache) = longest
                prompt + `max_new_tokens`.
            truncate: `None` refuses a prompt that does not fit; `"left"`
                keeps its start token and last tokens.

        Example:

        ```python
        lm.generate("The cell", max_new_tokens=8)
        ```
        """
        self.check_tokenizer()
        return causal_lm_inputs.generate(
            self,
            inputs,
            max_length=max_length,
            stop_token_ids=stop_token_ids,
            strip_prompt=strip_prompt,
            max_new_tokens=max_new_tokens,
            truncate=truncate,
        )

    def score(
        self,
        token_ids,
        padding_mask=None,
        scoring_mode="logits",
        layer_intercept_fn=None,
        target_ids=None,
    ):
        """Scores token sequences, like KerasHub's `CausalLM.score`.

        Args:
            token_ids: int `[b, s]`.
            padding_mask: optional `[b, s]` mask (defaults to all ones).
            scoring_mode: `"logits"` returns token log-probabilities over the
                real vocabulary `[b, s, V]` (float32, already normalised:
                `log_softmax` of them is the identity); `"loss"` returns the
                per-token negative log-likelihood of `target_ids` `[b, s]`.
            layer_intercept_fn: optional `fn(x, i)` applied to the input
                embeddings (`i = -1`) and to each block's output (`i = 0..`).
            target_ids: int `[b, s]`, required for `"loss"`.
        """
        if scoring_mode not in ("logits", "loss"):
            raise ValueError(
                "Unsupported scoring_mode. Must be one of 'logits' or 'loss'."
            )
        if scoring_mode == "loss" and target_ids is None:
            raise ValueError(
                "Cannot compute loss without targets. Please provide target "
                "token ids via the target_ids parameter."
            )
        self.check_tokenizer()
        check_token_ids(token_ids, self.backbone.vocabulary_size)
        if target_ids is not None:
            check_token_ids(
                target_ids, self.backbone.vocabulary_size, "Target ids"
            )
        if padding_mask is None:
            padding_mask = ops.ones(ops.shape(token_ids)[:2], dtype="int32")
        if scoring_mode == "loss" and layer_intercept_fn is None:
            from keras_mhf.next_token_scorer import target_losses

            # Compiled once per model and shape (the eager vocabulary scan
            # would be traced again on every call).
            return ops.convert_to_tensor(
                target_losses(self, token_ids, padding_mask, target_ids)
            )
        if layer_intercept_fn is None:

            def layer_intercept_fn(x, unused_i):
                return x

        x = layer_intercept_fn(self.backbone.embed(token_ids), -1)
        for i, block in enumerate(self.backbone.transformer_layers):
            x = layer_intercept_fn(
                block(x, decoder_padding_mask=padding_mask), i
            )
        hidden_states = self.backbone.layer_norm(x)
        if scoring_mode == "logits":
            return self.token_log_probs(hidden_states)
        # Only the target's score and the normaliser: no [b, s, V] tensor.
        target_log_probs, _, _ = self.next_token_statistics(
            hidden_states, target_ids
        )
        return -target_log_probs

    def export(
        self,
        filepath,
        format="tf_saved_model",
        verbose=None,
        overwrite=False,
        include_text_endpoints=None,
        **kwargs,
    ):
        """Exports a TF SavedModel with `serve`, `score` and `generate`
        endpoints on token ids and, with a tokenizer, `generate_text` and
        `score_text` on strings; works from every backend. See
        `keras_mhf.export`. Other formats go to `keras.Model.export`."""
        if format != "tf_saved_model" or kwargs:
            # Not `super()`: StandardCausalLM shares this method.
            return keras.Model.export(
                self, filepath, format=format, verbose=verbose, **kwargs
            )
        from keras_mhf.export import export_causal_lm

        return export_causal_lm(
            self,
            filepath,
            overwrite=overwrite,
            include_text_endpoints=include_text_endpoints,
            verbose=bool(verbose),
        )

    def export_to_transformers(
        self, path, overwrite=False, max_position_embeddings=32768
    ):
        """Writes a Hugging Face checkpoint in the authors' format
        (`config.json`, `model.safetensors`, `generation_config.json` and
        the tokenizer files) that their `Qwen3ForCausalLM` loads and
        `from_preset(path)` reads back; see
        `keras_mhf.utils.transformers.export_multi_hash_former`. A quantized
        model and an existing `path` (unless `overwrite`) are refused; the
        write is atomic.

        Example:

        ```python
        lm.export_to_transformers("exported_hf")
        MultiHashFormerCausalLM.from_preset("exported_hf")
        ```
        """
        from keras_mhf.utils.transformers import export_multi_hash_former

        return export_multi_hash_former.export_causal_lm(
            self, path, overwrite, max_position_embeddings
        )

    def calibrate(
        self, data, batch_size=8, sequence_length=None, max_tokens=4096
    ):
        """Fits `scoring_temperature` on held-out text and sets it.

        The fit is exact (Newton's method on the convex held-out NLL as a
        function of `1 / tau`) and needs one forward pass per block: the raw
        scores `s(w)` are cached (`max_tokens x V` floats). Greedy output
        never changes (a positive scale keeps the argmax); sampled and
        scored probabilities become calibrated. See `keras_mhf.calibration`.

        Args:
            data: held-out data: a prepared data directory (its validation
                split), a `.txt`/`.jsonl` file or directory, a list of
                documents, or an int array of token blocks `[n, L+1]`.
            batch_size: blocks per forward pass.
            sequence_length: block length for text (default: the
                preprocessor's, at most 512).
            max_tokens: predicted positions used (at least 100).

        Returns:
            A report: `temperature`, `previous_temperature`, `tokens`, and
            `paper_rule` / `before` / `after` metrics (`perplexity`, `loss`,
            `accuracy`, `ece`: expected calibration error of the top-1
            prediction, `mean_confidence`).

        Example:

        ```python
        report = lm.calibrate(held_out_documents)
        report["temperature"], report["after"]["perplexity"]
        ```
        """
        from keras_mhf import calibration

        report = calibration.calibrate(
            self, data, batch_size, sequence_length, max_tokens
        )
        self.scoring_temperature = report["temperature"]
        return report

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "scoring_temperature": self.scoring_temperature,
                "decoding": self.decoding,
                "candidate_buckets": self.candidate_buckets,
            }
        )
        return config

    # --- Vocabulary ---------------------------------------------------------

    def check_tokenizer(self, force=False):
        """Raises a clear error if the attached tokenizer does not match the
        model's signature table, or tokenizes differently from the tokenizer
        the model records (`backbone.tokenization_fingerprint`: same pieces,
        other scores, types or normalizer).

        The full check hashes the tokenizer's vocabulary; it runs whenever the
        attached tokenizer's `tokenization_fingerprint` differs from the last
        one that passed, or when `force` is set.
        """
        tokenizer = getattr(self.preprocessor, "tokenizer", None)
        if tokenizer is None:
            return
        fingerprint = vocabulary.tokenization_fingerprint(tokenizer)
        if fingerprint is None or (
            fingerprint == self._verified_tokenizer and not force
        ):
            return
        vocabulary.check_tokenizer(self.backbone, tokenizer)
        self._verified_tokenizer = fingerprint

    def expand_vocabulary(self, new_tokens=None, tokenizer=None):
        """Returns a model for a larger vocabulary, with no new parameters.

        New tokens are appended after the old ids and hashed with the same
        rule and seeds (paper Sec. 4.4), so every old signature, and so the
        old tokens' behaviour, is unchanged. Every trained weight is copied
        (by weight path) into the returned model.

        Args:
            new_tokens: list of new token strings (appended in order).
            tokenizer: alternatively, the expanded `MultiHashFormerTokenizer`:
                its first `V` pieces must be the current vocabulary, and the
                rest are the new tokens. It becomes the new model's tokenizer;
                without it the returned model has no preprocessor.

        Returns:
            A new `MultiHashFormerCausalLM`.
        """
        return vocabulary.expand_vocabulary(self, new_tokens, tokenizer)
