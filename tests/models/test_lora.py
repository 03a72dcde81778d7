"""LoRA fine-tuning (`keras_mhf.models.lora`): only the adapters (and, when
asked, the hash tables) change; saved adapters, merged weights and presets
give the same model back; it works after `expand_vocabulary`."""

import keras
import numpy as np
import pytest

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models import standard_causal_lm
from keras_mhf.models.lora import enable_lora
from keras_mhf.models.lora import lora_layers
from keras_mhf.models.lora import merge_lora
from keras_mhf.models.lora import unmerged_lora
from tests.conftest import CORPUS
from tests.conftest import small_proto_bytes

RANK = 2


def numpy_weights(model):
    return {
        v.path: np.array(keras.ops.convert_to_numpy(v.value))
        for v in model.weights
    }


def features(lm, texts=CORPUS[:4]):
    x, _, _ = lm.preprocessor(list(texts))
    return {k: keras.ops.convert_to_numpy(v) for k, v in x.items()}


def bucket_logits(lm, x):
    hidden = lm.backbone(x)
    return np.asarray(
        keras.ops.convert_to_numpy(lm.backbone.hash_decoder(hidden))
    )


def fine_tune(lm, steps=3, learning_rate=1e-2):
    lm.compile(optimizer=keras.optimizers.Adam(learning_rate))
    lm.fit(list(CORPUS[: 2 * steps]), batch_size=2, epochs=1, verbose=0)


@pytest.fixture(scope="module")
def tokenizer():
    return MultiHashFormerTokenizer(small_proto_bytes())


@pytest.fixture(scope="module")
def base_preset(tokenizer, tmp_path_factory):
    keras.utils.set_random_seed(0)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b64", sequence_length=16
    )
    path = str(tmp_path_factory.mktemp("lora") / "base")
    lm.save_to_preset(path)
    return path, numpy_weights(lm)


@pytest.fixture(scope="module")
def tuned(base_preset):
    """A LoRA model trained for a few steps, with the weights it started
    from."""
    path, before = base_preset
    lm = MultiHashFormerCausalLM.from_preset(path)
    keras.utils.set_random_seed(1)
    enable_lora(lm, RANK)
    fine_tune(lm)
    return lm, before


def test_only_adapters_train(base_preset):
    lm = MultiHashFormerCausalLM.from_preset(base_preset[0])
    assert enable_lora(lm, RANK) is lm
    trainable = {v.path for v in lm.trainable_weights}
    assert trainable and all("lora_kernel" in p for p in trainable)
    layers = lora_layers(lm)
    assert sorted({layer.name for layer in layers}) == ["query", "value"]
    assert len(layers) == 2 * lm.backbone.num_layers
    # Fresh adapters (B = 0) change nothing.
    x = features(lm)
    base = MultiHashFormerCausalLM.from_preset(base_preset[0])
    np.testing.assert_array_equal(bucket_logits(lm, x), bucket_logits(base, x))


def test_fit_changes_only_lora_weights(tuned):
    lm, before = tuned
    after = numpy_weights(lm)
    changed = {p for p in after if p in before}
    changed = {p for p in changed if not np.array_equal(after[p], before[p])}
    assert changed == set(), changed  # every base weight is frozen
    adapters = [p for p in after if p.endswith("lora_kernel_b")]
    assert adapters and all(np.abs(after[p]).max() > 0 for p in adapters)


def test_saved_adapters_merge_and_preset_give_the_same_model(
    tuned, base_preset, tmp_path
):
    lm, _ = tuned
    x = features(lm)
    expected = bucket_logits(lm, x)
    # 1. The adapters file on the base preset.
    adapter = str(tmp_path / "adapter.lora.h5")
    lm.backbone.save_lora_weights(adapter)
    again = MultiHashFormerCausalLM.from_preset(base_preset[0])
    again.backbone.load_lora_weights(adapter)  # enables LoRA itself
    np.testing.assert_array_equal(bucket_logits(again, x), expected)
    # 2. A preset of the LoRA model is a plain model with merged kernels.
    lm.save_to_preset(str(tmp_path / "merged"))
    plain = MultiHashFormerCausalLM.from_preset(str(tmp_path / "merged"))
    assert lora_layers(plain) == []
    np.testing.assert_allclose(
        bucket_logits(plain, x), expected, rtol=1e-5, atol=1e-5
    )
    # 3. merge_lora in place: the same function, the kernels Keras saves.
    assert merge_lora(again) == len(lora_layers(again))
    np.testing.assert_allclose(
        bucket_logits(again, x), expected, rtol=1e-5, atol=1e-5
    )
    saved = numpy_weights(plain)
    for layer in lora_layers(again):
        kernel = keras.ops.convert_to_numpy(layer.kernel)
        np.testing.assert_allclose(
            kernel, saved[layer.path + "/kernel"], rtol=1e-6, atol=1e-7
        )
        b = keras.ops.convert_to_numpy(layer.lora_kernel_b)
        assert not b.any()


def test_merge_matches_keras_forward():
    """merge_lora's kernel computes what Keras' LoRA forward computes."""
    keras.utils.set_random_seed(3)
    layer = keras.layers.EinsumDense("btd,dk->btk", output_shape=(None, 6))
    x = np.random.default_rng(0).normal(size=(2, 3, 5)).astype("float32")
    layer(x)
    layer.enable_lora(2)
    layer.lora_kernel_b.assign(
        np.random.default_rng(1).normal(size=(2, 6)).astype("float32")
    )
    lora_output = keras.ops.convert_to_numpy(layer(x))
    kernel = keras.ops.convert_to_numpy(layer.lora_kernel_a) @ (
        keras.ops.convert_to_numpy(layer.lora_kernel_b)
    )
    kernel = kernel + keras.ops.convert_to_numpy(layer.variables[0])
    np.testing.assert_allclose(
        lora_output, np.einsum("btd,dk->btk", x, kernel), rtol=1e-5, atol=1e-5
    )

    class Holder(keras.Model):  # merge_lora reads `.backbone`
        pass

    holder = Holder()
    holder.backbone = keras.Sequential([layer])
    assert merge_lora(holder) == 1
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(layer(x)), lora_output, rtol=1e-5, atol=1e-5
    )


def test_unmerged_checkpoint_restores_the_exact_state(tuned, base_preset):
    lm, _ = tuned
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        weights, adapter = f"{root}/m.weights.h5", f"{root}/m.lora.h5"
        with unmerged_lora(lm):
            lm.save_weights(weights)
        assert lora_layers(lm)  # restored after the context
        lm.backbone.save_lora_weights(adapter)
        again = MultiHashFormerCausalLM.from_preset(base_preset[0])
        enable_lora(again, RANK)
        again.compile(optimizer=keras.optimizers.Adam(1e-2))
        again.optimizer.build(again.trainable_variables)
        again.load_weights(weights)
        again.backbone.load_lora_weights(adapter)
    expected, found = numpy_weights(lm), numpy_weights(again)
    assert expected.keys() == found.keys()
    for path in expected:
        np.testing.assert_array_equal(found[path], expected[path], path)
    for saved, loaded in zip(lm.optimizer.variables, again.optimizer.variables):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(loaded),
            keras.ops.convert_to_numpy(saved),
        )


def test_errors(base_preset, tokenizer):
    lm = MultiHashFormerCausalLM.from_preset(base_preset[0])
    trainable = [v.path for v in lm.trainable_weights]
    for rank in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="rank must be an integer >= 1"):
            enable_lora(lm, rank)
    with pytest.raises(ValueError, match="train_tables must be True or"):
        enable_lora(lm, 2, train_tables="yes")
    with pytest.raises(ValueError, match="No layer of this model is named"):
        enable_lora(lm, 2, target_layer_names=["nothing"])
    # Nothing was changed by the refusals.
    assert [v.path for v in lm.trainable_weights] == trainable
    enable_lora(lm, 2)
    with pytest.raises(ValueError, match="already enabled"):
        enable_lora(lm, 2)
    with pytest.raises(ValueError, match="MultiHashFormer and Standard"):
        enable_lora(keras.Sequential([keras.layers.Dense(2)]), 2)
    quantized = MultiHashFormerCausalLM.from_preset(base_preset[0])
    quantized.quantize("int8")
    with pytest.raises(ValueError, match="quantized model"):
        enable_lora(quantized, 2)


def test_after_expansion_with_trainable_tables(base_preset, tmp_path):
    from keras_mhf.expansion.tokenizer_expansion import expand_sentencepiece

    new_proto, pieces = expand_sentencepiece(
        small_proto_bytes(),
        {"zh": ["细胞是生命的基本单位。", "水在海平面一百度沸腾。"] * 4},
        pieces_per_language=8,
    )
    (tmp_path / "new.model").write_bytes(new_proto)
    base = MultiHashFormerCausalLM.from_preset(base_preset[0])
    grown = base.expand_vocabulary(
        tokenizer=MultiHashFormerTokenizer(str(tmp_path / "new.model"))
    )
    before = numpy_weights(grown)
    enable_lora(grown, RANK, train_tables=True)
    trainable = {v.path for v in grown.trainable_weights}
    tables = {p for p in trainable if "lora_kernel" not in p}
    assert tables == {
        f"hash_encoder/embeddings_{i}" for i in range(grown.backbone.num_hashes)
    }
    grown.compile(optimizer=keras.optimizers.Adam(1e-2))
    texts = ["细胞是生命的基本单位。"] * 2 + list(CORPUS[:2])
    grown.fit(texts, batch_size=2, epochs=1, verbose=0)
    after = numpy_weights(grown)
    changed = {p for p in before if not np.array_equal(after[p], before[p])}
    assert changed == tables
    x = features(grown, texts)
    expected = bucket_logits(grown, x)
    grown.save_to_preset(str(tmp_path / "tuned"))
    again = MultiHashFormerCausalLM.from_preset(str(tmp_path / "tuned"))
    assert again.backbone.vocabulary_size == grown.backbone.vocabulary_size
    np.testing.assert_allclose(
        bucket_logits(again, x), expected, rtol=1e-5, atol=1e-5
    )


def test_standard_model(tokenizer):
    keras.utils.set_random_seed(0)
    lm = standard_causal_lm(tokenizer, "tiny", sequence_length=16)
    before = numpy_weights(lm)
    enable_lora(lm, RANK, train_tables=True)
    trainable = {v.path for v in lm.trainable_weights}
    assert "token_embedding/embeddings" in trainable
    assert all(
        "lora_kernel" in p for p in trainable - {"token_embedding/embeddings"}
    )
    fine_tune(lm, steps=1)
    after = numpy_weights(lm)
    changed = {p for p in before if not np.array_equal(after[p], before[p])}
    assert changed == {"token_embedding/embeddings"}
