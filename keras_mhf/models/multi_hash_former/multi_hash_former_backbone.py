import keras
from keras_hub.models import Backbone

from keras_mhf.layers.cascade_hash_decoder import CascadeHashDecoder
from keras_mhf.layers.hash_encoder import HashEncoder
from keras_mhf.layers.signature_lookup import SignatureLookup
from keras_mhf.models import quantization
from keras_mhf.models.multi_hash_former.multi_hash_former_layout import (
    fit_layout_to_weights,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_layout import (
    layout_map,
)
from keras_mhf.models.preset_consistency import check_preset_of_weights
from keras_mhf.models.qwen3_decoder_block import TRUNK_DIMENSIONS
from keras_mhf.models.qwen3_decoder_block import TRUNK_OPTIONS
from keras_mhf.models.qwen3_decoder_block import make_trunk_layers
from keras_mhf.models.qwen3_decoder_block import trunk_arguments
from keras_mhf.models.qwen3_decoder_block import trunk_graph
from keras_mhf.signatures.signature_table import SignatureTable
from keras_mhf.signatures.signature_table import check_num_buckets
from keras_mhf.signatures.signature_table import check_num_lsh
from keras_mhf.utils import keras_utils
from keras_mhf.utils.arguments import check_positive_ints
from keras_mhf.utils.keras_utils import argument_names
from keras_mhf.utils.keras_utils import check_known_kwargs

# Marks a backbone rebuilt from its config: the table comes from the weights.
_TABLE_FROM_WEIGHTS = "from_weights"
# The weight dimensions (ints >= 1; they also fit a layout map).
_DIMENSIONS = ("num_hashes", "num_buckets", *TRUNK_DIMENSIONS)
_DIMENSIONS += ("gate_dim", "mixer_dim")
# The constructor arguments `get_config` records (with `signatures: None`).
_CONFIG = ("vocabulary_size", *_DIMENSIONS, *TRUNK_OPTIONS, "pad_token_id")
_CONFIG += ("signature_rule", "tokenization_fingerprint", "num_lsh")


@keras.saving.register_keras_serializable(package="keras_mhf")
class MultiHashFormerBackbone(Backbone):
    """MultiHashFormer trunk: signatures -> hash encoder -> Qwen3 blocks ->
    norm.

    Token ids are mapped to their `H` bucket ids by a `SignatureLookup` (paper
    Sec. 3.1), embedded by a `HashEncoder` (gated compositional embedding,
    Sec. 3.1), processed by Qwen3 decoder blocks from KerasHub (Sec. 3.2), and
    normalised by a final RMSNorm. The output is the hidden state `h_t` that
    `MultiHashFormerCausalLM`'s `CascadeHashDecoder` (Sec. 3.3) reads, tied to
    `hash_encoder.embeddings`. No parameter depends on the vocabulary size.

    Args:
        vocabulary_size: int, `V`, rows of the signature table.
        num_hashes: int, `H`.
        num_buckets: int, `B` (bucket 0 included).
        num_layers: int, decoder blocks.
        num_query_heads: int.
        num_key_value_heads: int (GQA).
        head_dim: int.
        hidden_dim: int, `d`.
        intermediate_dim: int, SwiGLU width.
        gate_dim: int, encoder gate width `g`. Defaults to 64.
        mixer_dim: int, cascade mixer width `m` (used by the task's decoder).
            Defaults to 64.
        rope_max_wavelength: float, RoPE theta. Defaults to 1e6.
        rope_scaling_factor: float. Defaults to 1.0.
        layer_norm_epsilon: float, every RMSNorm (q/k norms included).
            Defaults to 1e-6.
        dropout: float. Defaults to 0.
        rematerialize: bool, recompute each decoder block's activations in
            the backward pass instead of keeping them (gradient
            checkpointing; see `Qwen3DecoderBlock`): trains larger batches
            in the same memory for about a third more compute. The same
            numbers. Defaults to False.
        pad_token_id: int or `None`, the token with the all-zero signature.
        signature_rule: `"unique"` or `"reference"`, the rule the table was
            built with (used to expand it and to check tokenizers).
        num_lsh: int, leading heads of the table that are the authors' LSH
            ids (their ablation, paper Sec. 6; `0 <= num_lsh <= num_hashes`).
            Only the table depends on it. Defaults to 0.
        signatures: a `SignatureTable` or int array `[V, H]`. Required when
            building a new backbone; a backbone rebuilt from its config gets
            the table from the saved weights.
        tokenization_fingerprint: str or `None`, the
            `tokenization_fingerprint` of the tokenizer the model was built
            for (its pieces, scores, types and normalizer); a tokenizer that
            tokenizes differently is then refused even when its pieces hash
            to the same signatures. `None` (models saved before it was
            recorded, or built from bare token strings): only the signatures
            are checked.
        dtype: dtype policy of the model.
        **kwargs: standard `keras.Model` arguments.

    Example:

    ```python
    tokens = ["<pad>"] + [f"tok{i}" for i in range(99)]
    table = keras_mhf.SignatureTable.from_tokens(tokens, 3, 64, pad_token_id=0)
    backbone = keras_mhf.models.MultiHashFormerBackbone(
        vocabulary_size=100, num_hashes=3, num_buckets=64, num_layers=2,
        num_query_heads=4, num_key_value_heads=2, head_dim=8, hidden_dim=32,
        intermediate_dim=64, pad_token_id=0, signatures=table,
    )
    backbone({"token_ids": np.ones((1, 5), "int32"),
              "padding_mask": np.ones((1, 5), "int32")})  # [1, 5, 32]
    ```
    """

    def __init__(
        self,
        vocabulary_size,
        num_hashes,
        num_buckets,
        num_layers,
        num_query_heads,
        num_key_value_heads,
        head_dim,
        hidden_dim,
        intermediate_dim,
        gate_dim=64,
        mixer_dim=64,
        rope_max_wavelength=1_000_000,
        rope_scaling_factor=1.0,
        layer_norm_epsilon=1e-6,
        dropout=0.0,
        rematerialize=False,
        pad_token_id=None,
        signature_rule="unique",
        tokenization_fingerprint=None,
        signatures=None,
        dtype=None,
        num_lsh=0,
        **kwargs,
    ):
        dtype = keras_utils.model_dtype(dtype)  # see preset_dtype
        arguments = {n: v for n, v in locals().items() if n in _CONFIG}
        initial_table = _check_arguments(arguments, signatures, kwargs)
        # A MultiHashFormerLayoutMap fits itself to the weights about to be
        # created (dimensions its mesh axes do not divide are replicated).
        fit_layout_to_weights(**arguments)
        # === Layers ===
        self.signature_lookup = SignatureLookup(
            vocabulary_size,
            num_hashes,
            num_buckets,
            pad_token_id,
            signatures=initial_table,
            dtype=dtype,
            name="signature_lookup",
        )
        self.hash_encoder = HashEncoder(
            num_hashes,
            num_buckets,
            hidden_dim,
            gate_dim=gate_dim,
            dtype=dtype,
            name="hash_encoder",
        )
        self.transformer_layers, self.layer_norm = make_trunk_layers(
            trunk_arguments(arguments), dtype
        )

        # === Functional Model ===
        inputs, sequence_output = trunk_graph(
            self.embed, self.transformer_layers, self.layer_norm
        )
        super().__init__(
            inputs=inputs, outputs=sequence_output, dtype=dtype, **kwargs
        )
        # The cascade decoder (Sec. 3.3) reads the encoder's tables and is
        # part of the backbone's weights, so a preset's `model.weights.h5`
        # holds the whole model and can never leave the decoder randomly
        # initialised. It is built last (after the trunk's weights are drawn).
        self.hash_decoder = CascadeHashDecoder(
            self.hash_encoder,
            mixer_dim=mixer_dim,
            dtype=dtype,
            name="hash_decoder",
        )
        self.hash_decoder.build((None, hidden_dim))

        # === Config ===
        for name, value in arguments.items():
            setattr(self, name, value)

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """`keras.Model.quantize` (int8, int4, or GPTQ/AWQ calibrating the
        Qwen3 blocks), plus the hash encoder's bucket tables (Keras' int8 /
        int4 quantizers; see `HashEncoder.quantize`), which Keras does not
        reach because the encoder holds sublayers. The int signature table
        stays as it is. See `keras_mhf.models.quantization`."""
        quantization.quantize_backbone(
            self, super().quantize, mode, config, filters, **kwargs
        )

    def get_quantization_layer_structure(self, mode):
        """What `quantize("gptq"/"awq", config=...)` calibrates: the
        signature lookup and hash encoder before the blocks, then the Qwen3
        blocks in order; see
        `keras_mhf.models.quantization.quantization_layer_structure`."""
        return quantization.quantization_layer_structure(self, mode)

    def quantize_hash_tables(self, mode, config=None, filters=None):
        """Quantizes the bucket tables (called by the backbone's and the
        causal LM's `quantize`); see
        `keras_mhf.models.quantization.quantize_hash_tables`."""
        quantization.quantize_hash_tables(self, mode, config, filters)

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """`Backbone.from_preset` in the precision the preset was saved in
        unless `dtype=` says otherwise (`keras_utils.keep_saved_precision`)."""
        kwargs = keras_utils.keep_saved_precision(preset, kwargs)
        return super().from_preset(preset, load_weights=load_weights, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights`, strict: a corrupt or truncated file, or
        one of a model with another configuration, is a clear `ValueError`
        naming the file (never a partial load). A preset's weight file is
        read only if the preset's files agree with each other
        (`keras_mhf.models.preset_consistency`)."""
        check_preset_of_weights(filepath)
        try:
            return super().load_weights(filepath, *args, **kwargs)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(
                f"Cannot load MultiHashFormer weights from {filepath}: the "
                "file is corrupt or truncated, or holds the weights of a "
                "model with another configuration "
                f"({type(error).__name__}: {error})."
                " Re-save the model (`save_to_preset`) or load the preset "
                "that belongs to this config.json."
            ) from error

    def export_to_transformers(
        self, path, overwrite=False, max_position_embeddings=32768
    ):
        """Writes `config.json`, `generation_config.json` and
        `model.safetensors` in the authors' Hugging Face format (the whole
        model: the cascade decoder is part of the backbone; no tokenizer).
        See `MultiHashFormerCausalLM.export_to_transformers`.

        Example:

        ```python
        backbone.export_to_transformers("exported_backbone")
        ```
        """
        from keras_mhf.export.transformers import export_multi_hash_former

        return export_multi_hash_former.export_backbone(
            self, path, overwrite, max_position_embeddings
        )

    def embed(self, token_ids):
        """Token ids `[b, s]` -> input embeddings `[b, s, d]` (Sec. 3.1)."""
        return self.hash_encoder(self.signature_lookup(token_ids))

    def get_signature_table(self, tokens=None):
        """The stored table as a `SignatureTable` (pass `tokens` to expand
        it)."""
        return SignatureTable(
            self.signature_lookup.get_signatures(),
            self.num_buckets,
            self.pad_token_id,
            self.signature_rule,
            tokens,
            self.num_lsh,
        )

    @staticmethod
    def get_layout_map(
        device_mesh,
        model_parallel_dim_name="model",
        data_parallel_dim_name="batch",
        config=None,
    ):
        """A `keras.distribution.LayoutMap` for model parallelism.

        Like KerasHub's Llama/Gemma layout maps: the bucket tables are
        sharded over buckets on the model axis (each head's `[B, d]` table ->
        `(model, data)`), the encoder's gate and output kernels, the
        attention and MLP kernels and the cascade mixers are split between
        the two axes, and the int signature table, norms and biases are
        replicated. The map (a `MultiHashFormerLayoutMap`) fits itself to
        each backbone built under the distribution holding it: every
        dimension that its mesh axis does not divide (e.g. 2 KV heads on a
        4-way axis) is replicated instead of failing inside JAX, with a
        warning naming the weights. `config` (`get_config()`, or
        `architecture_config(...)`) fits it at once, so that
        `check_layout_map` can inspect it before anything is built. The same
        rules serve the Standard baseline's trunk.

        Args:
            device_mesh: a `keras.distribution.DeviceMesh`.
            model_parallel_dim_name: the mesh axis that shards weights.
            data_parallel_dim_name: the mesh axis that shards the batch.
            config: optional backbone config to fit the layout to now.

        Example:

        ```python
        mesh = keras.distribution.DeviceMesh(
            (2, 4), ("batch", "model"), keras.distribution.list_devices()
        )
        layout_map = MultiHashFormerBackbone.get_layout_map(mesh)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        )
        ```
        """
        return layout_map(
            device_mesh,
            model_parallel_dim_name,
            data_parallel_dim_name,
            config=config,
        )

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if config.get("signatures") is None:
            config["signatures"] = _TABLE_FROM_WEIGHTS
        return super().from_config(config)

    def get_config(self):
        config = super().get_config()
        config.update({name: getattr(self, name) for name in _CONFIG})
        # The table itself travels in the weights (`signature_lookup`).
        config["signatures"] = None
        config["dtype"] = keras_utils.preset_dtype(config.get("dtype"))
        return config


def _check_arguments(arguments, signatures, kwargs):
    """The backbone's argument checks (names, sizes, LSH heads, the table);
    returns the table to initialise `SignatureLookup` with (`None` for a
    backbone rebuilt from its config: the table comes from the weights)."""
    owner = "MultiHashFormerBackbone"
    check_known_kwargs(owner, kwargs, argument_names(MultiHashFormerBackbone))
    sizes = ("vocabulary_size",) + _DIMENSIONS
    check_positive_ints(owner, **{name: arguments[name] for name in sizes})
    check_num_buckets(owner, arguments["num_buckets"])
    num_hashes, rule = arguments["num_hashes"], arguments["signature_rule"]
    try:
        check_num_lsh(arguments["num_lsh"], num_hashes, rule)
    except ValueError as error:
        raise ValueError(f"{owner}: {error}") from None
    if signatures is None:
        raise ValueError(
            "MultiHashFormerBackbone needs its signature table: pass "
            "`signatures=keras_mhf.SignatureTable.from_tokens(...)` (or an "
            "int array [vocabulary_size, num_hashes]), or build the whole "
            "model with "
            "`MultiHashFormerCausalLM.from_tokenizer(tokenizer, ...)`."
        )
    if isinstance(signatures, str):
        if signatures != _TABLE_FROM_WEIGHTS:
            raise ValueError(f"Unknown `signatures` value {signatures!r}.")
        return None
    if isinstance(signatures, SignatureTable):
        _check_table_matches(
            signatures,
            num_hashes,
            arguments["num_buckets"],
            arguments["pad_token_id"],
            rule,
            arguments["num_lsh"],
        )
    return signatures


def _check_table_matches(
    table, num_hashes, num_buckets, pad_token_id, rule, num_lsh=0
):
    expected = dict(
        num_hashes=num_hashes,
        num_buckets=num_buckets,
        pad_token_id=pad_token_id,
        signature_rule=rule,
        num_lsh=num_lsh,
    )
    actual = dict(
        num_hashes=table.num_hashes,
        num_buckets=table.num_buckets,
        pad_token_id=table.pad_token_id,
        signature_rule=table.rule,
        num_lsh=table.num_lsh,
    )
    wrong = {k: (actual[k], v) for k, v in expected.items() if actual[k] != v}
    if wrong:
        details = ", ".join(
            f"{k}: table {a!r} vs backbone {b!r}" for k, (a, b) in wrong.items()
        )
        raise ValueError(
            f"The SignatureTable does not match the backbone ({details})."
        )
