import keras
import keras_hub
import numpy as np
from keras import ops
from keras_hub.src.tests.test_case import TestCase

from keras_mhf.models import MultiHashFormerCausalLMPreprocessor
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models import StandardBackbone
from keras_mhf.models import StandardCausalLM
from keras_mhf.models import standard_causal_lm
from keras_mhf.models.multi_hash_former.multi_hash_former_architectures import (
    TRUNKS,
)
from tests.conftest import assert_greedy_continuation
from tests.conftest import small_proto_bytes

BACKBONE_KWARGS = dict(
    vocabulary_size=120,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    hidden_dim=16,
    intermediate_dim=32,
)


class StandardTest(TestCase):
    def setUp(self):
        self.tokenizer = MultiHashFormerTokenizer(small_proto_bytes())
        self.preprocessor = MultiHashFormerCausalLMPreprocessor(
            self.tokenizer, sequence_length=8
        )
        self.train_data = (
            ["The cell is the basic unit", "Water boils at one hundred"],
        )
        self.input_data = self.preprocessor(*self.train_data)[0]

    def test_backbone_basics(self):
        self.run_backbone_test(
            cls=StandardBackbone,
            init_kwargs=BACKBONE_KWARGS,
            input_data=self.input_data,
            expected_output_shape=(2, 8, 16),
        )

    def test_causal_lm_basics(self):
        self.run_task_test(
            cls=StandardCausalLM,
            init_kwargs={
                "preprocessor": self.preprocessor,
                "backbone": StandardBackbone(**BACKBONE_KWARGS),
            },
            train_data=self.train_data,
            expected_output_shape=(2, 8, 120),
        )

    def test_same_trunk_weights_as_stock_qwen3_under_one_seed(self):
        keras.utils.set_random_seed(3)
        ours = StandardBackbone(**BACKBONE_KWARGS)
        keras.utils.set_random_seed(3)
        stock = keras_hub.models.Qwen3Backbone(
            **BACKBONE_KWARGS,
            rope_max_wavelength=1_000_000,
            sliding_window_size=None,
        )
        stock_weights = {w.path: w for w in stock.weights}
        for w in ours.weights:
            if w.path != "token_embedding/embeddings":
                np.testing.assert_array_equal(
                    ops.convert_to_numpy(w),
                    ops.convert_to_numpy(stock_weights[w.path]),
                )


def test_same_trunk_and_tokenizer(small_tokenizer, corpus, tmp_path):
    keras.utils.set_random_seed(0)
    lm = standard_causal_lm(
        small_tokenizer, "tiny_h3b64", extra_layers=1, sequence_length=16
    )
    assert isinstance(lm, StandardCausalLM)
    assert isinstance(lm, keras_hub.models.Qwen3CausalLM)
    backbone = lm.backbone
    assert backbone.num_layers == TRUNKS["tiny"]["num_layers"] + 1
    assert backbone.vocabulary_size == small_tokenizer.vocabulary_size()
    assert backbone.rope_max_wavelength == 1_000_000
    attention = backbone.transformer_layers[0]._self_attention_layer
    assert attention._query_dense_layer_norm.epsilon == 1e-6
    std = float(
        np.std(keras.ops.convert_to_numpy(backbone.token_embedding.embeddings))
    )
    assert abs(std - 0.02) < 0.005
    lm.compile(optimizer=keras.optimizers.AdamW(1e-2))
    history = lm.fit(corpus, batch_size=8, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert_greedy_continuation(lm, length=10)
    preset = str(tmp_path / "standard")
    lm.save_to_preset(preset)
    restored = keras_hub.models.CausalLM.from_preset(preset)
    assert isinstance(restored, StandardCausalLM)
    # The reloaded model keeps the 1e-6 q/k-norm epsilon (no global patch).
    restored_attention = restored.backbone.transformer_layers[
        0
    ]._self_attention_layer
    assert restored_attention._query_dense_layer_norm.epsilon == 1e-6
    x, _, _ = lm.preprocessor(corpus[:2])
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(restored(x)),
        keras.ops.convert_to_numpy(lm(x)),
        atol=1e-5,
    )
