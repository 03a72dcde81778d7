import keras
import keras_hub
import numpy as np

from keras_mhf.models import standard_causal_lm
from keras_mhf.models.multi_hash_former_architectures import TRUNKS


def test_same_trunk_and_tokenizer(small_tokenizer, corpus, tmp_path):
    keras.utils.set_random_seed(0)
    lm = standard_causal_lm(small_tokenizer, "tiny_h3b64", extra_layers=1, sequence_length=16)
    assert isinstance(lm, keras_hub.models.Qwen3CausalLM)
    backbone = lm.backbone
    assert backbone.num_layers == TRUNKS["tiny"]["num_layers"] + 1
    assert backbone.vocabulary_size == small_tokenizer.vocabulary_size()
    assert backbone.rope_max_wavelength == 1_000_000
    assert backbone.sliding_window_size is None
    attention = backbone.transformer_layers[0]._self_attention_layer
    assert attention._query_dense_layer_norm.epsilon == 1e-6
    std = float(np.std(keras.ops.convert_to_numpy(backbone.token_embedding.embeddings)))
    assert abs(std - 0.02) < 0.005
    lm.compile(optimizer=keras.optimizers.AdamW(1e-2), loss=lm.loss)
    history = lm.fit(corpus, batch_size=8, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert lm.generate("The cell", max_length=10)
    preset = str(tmp_path / "standard")
    lm.save_to_preset(preset)
    restored = keras_hub.models.CausalLM.from_preset(preset)
    x, _, _ = lm.preprocessor(corpus[:2])
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(restored(x)), keras.ops.convert_to_numpy(lm(x)), atol=1e-5
    )
