import keras
from keras.layers import ReversibleEmbedding
from keras_hub.models import Backbone

from keras_mhf.models.multi_hash_former.multi_hash_former_layout import (
    fit_layout_to_weights,
)
from keras_mhf.models.preset_consistency import check_preset_of_weights
from keras_mhf.models.qwen3_decoder_block import TRUNK_ARGUMENTS
from keras_mhf.models.qwen3_decoder_block import make_trunk_layers
from keras_mhf.models.qwen3_decoder_block import trunk_arguments
from keras_mhf.models.qwen3_decoder_block import trunk_graph
from keras_mhf.utils import keras_utils
from keras_mhf.utils.keras_utils import argument_names
from keras_mhf.utils.keras_utils import check_known_kwargs


@keras.saving.register_keras_serializable(package="keras_mhf")
class StandardBackbone(Backbone):
    """The Standard baseline's trunk (paper Sec. 4.1, "Baselines").

    KerasHub's `Qwen3Backbone` layer for layer (a tied `ReversibleEmbedding`
    of `V x d`, Qwen3 decoder blocks, a final RMSNorm; the same layer names
    and weight paths), built from the same `Qwen3DecoderBlock` as
    `MultiHashFormerBackbone`, so every RMSNorm (q/k norms included) uses
    `layer_norm_epsilon`, and with the paper's defaults: RoPE theta 1e6, eps
    1e-6, full attention, tied embeddings. The embedding is initialised
    N(0, 0.02), the authors' initialisation; it is drawn after the trunk, so
    a `StandardBackbone` and a `Qwen3Backbone` built under the same seed have
    identical trunk weights.

    Args:
        vocabulary_size: int, `V`.
        num_layers: int, decoder blocks.
        num_query_heads: int.
        num_key_value_heads: int (GQA).
        head_dim: int.
        hidden_dim: int, `d`.
        intermediate_dim: int, SwiGLU width.
        rope_max_wavelength: float, RoPE theta. Defaults to 1e6.
        rope_scaling_factor: float. Defaults to 1.0.
        layer_norm_epsilon: float, every RMSNorm. Defaults to 1e-6.
        dropout: float. Defaults to 0.
        rematerialize: bool, recompute each decoder block's activations in
            the backward pass instead of keeping them (gradient
            checkpointing; see `Qwen3DecoderBlock`): trains larger batches
            in the same memory for about a third more compute. The same
            numbers. Defaults to False.
        dtype: dtype policy of the model.
        **kwargs: standard `keras.Model` arguments.

    Example:

    ```python
    backbone = keras_mhf.models.StandardBackbone(
        vocabulary_size=100, num_layers=2, num_query_heads=4,
        num_key_value_heads=2, head_dim=8, hidden_dim=32, intermediate_dim=64,
    )
    backbone({"token_ids": np.ones((1, 5), "int32"),
              "padding_mask": np.ones((1, 5), "int32")})  # [1, 5, 32]
    ```
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_query_heads,
        num_key_value_heads,
        head_dim,
        hidden_dim,
        intermediate_dim,
        rope_max_wavelength=1_000_000,
        rope_scaling_factor=1.0,
        layer_norm_epsilon=1e-6,
        dropout=0.0,
        rematerialize=False,
        dtype=None,
        **kwargs,
    ):
        check_known_kwargs(
            "StandardBackbone", kwargs, argument_names(type(self))
        )
        dtype = keras_utils.model_dtype(dtype)  # see preset_dtype
        trunk = trunk_arguments(locals())
        # A MultiHashFormerLayoutMap fits itself to the trunk's weights.
        fit_layout_to_weights(**trunk)
        # === Layers ===
        self.token_embedding = ReversibleEmbedding(
            input_dim=vocabulary_size,
            output_dim=hidden_dim,
            tie_weights=True,
            # KerasHub's Qwen3 initialiser; redrawn N(0, 0.02) below.
            embeddings_initializer=keras.initializers.RandomNormal(stddev=0.01),
            dtype=dtype,
            name="token_embedding",
        )
        self.transformer_layers, self.layer_norm = make_trunk_layers(
            trunk, dtype
        )

        # === Functional Model ===
        inputs, sequence_output = trunk_graph(
            self.token_embedding, self.transformer_layers, self.layer_norm
        )
        super().__init__(
            inputs=inputs, outputs=sequence_output, dtype=dtype, **kwargs
        )
        embeddings = self.token_embedding.embeddings
        if keras.backend.is_float_dtype(embeddings.dtype):  # not when quantized
            embeddings.assign(
                keras.initializers.RandomNormal(stddev=0.02)(
                    embeddings.shape, embeddings.dtype
                )
            )

        # === Config ===
        self.vocabulary_size = vocabulary_size
        for name, value in trunk.items():
            setattr(self, name, value)

    def export_to_transformers(
        self, path, overwrite=False, max_position_embeddings=32768
    ):
        """Writes a stock Hugging Face `Qwen3ForCausalLM` checkpoint
        (no tokenizer); see `StandardCausalLM.export_to_transformers`.

        Example:

        ```python
        backbone.export_to_transformers("exported_standard_backbone")
        ```
        """
        from keras_mhf.export.transformers import export_qwen3

        return export_qwen3.export_backbone(
            self, path, overwrite, max_position_embeddings
        )

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        """`Backbone.from_preset` in the precision the preset was saved in
        unless `dtype=` says otherwise (`keras_utils.keep_saved_precision`)."""
        kwargs = keras_utils.keep_saved_precision(preset, kwargs)
        return super().from_preset(preset, load_weights=load_weights, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights`; a preset's weight file is read only
        if the preset's files agree with each other
        (`keras_mhf.models.preset_consistency`)."""
        check_preset_of_weights(filepath)
        return super().load_weights(filepath, *args, **kwargs)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                **{name: getattr(self, name) for name in TRUNK_ARGUMENTS},
            }
        )
        config["dtype"] = keras_utils.preset_dtype(config.get("dtype"))
        return config
