import keras
import numpy as np
import pytest
from keras import ops

from keras_mhf.models import MultiHashFormerBackbone
from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import StandardBackbone
from keras_mhf.models import StandardCausalLM
from keras_mhf.models import standard_causal_lm


def test_mixed_bfloat16_fit_generate_score(small_tokenizer, corpus):
    keras.utils.set_random_seed(0)
    full = MultiHashFormerCausalLM.from_tokenizer(
        small_tokenizer, "tiny_h3b64", sequence_length=16
    )
    half = MultiHashFormerCausalLM.from_tokenizer(
        small_tokenizer,
        "tiny_h3b64",
        sequence_length=16,
        dtype="mixed_bfloat16",
    )
    for a, b in zip(full.weights, half.weights):
        b.assign(a)
    assert half.backbone.hash_encoder.compute_dtype == "bfloat16"
    assert (
        keras.backend.standardize_dtype(
            half.backbone.hash_encoder.embeddings[0].dtype
        )
        == "float32"
    )
    x, y, sw = full.preprocessor(corpus[:4])

    # Vocabulary log-probs are float32 under bf16 compute, and close to fp32.
    lp_full = np.asarray(
        ops.convert_to_numpy(full.score(x["token_ids"], x["padding_mask"]))
    )
    lp_half = half.score(x["token_ids"], x["padding_mask"])
    assert keras.backend.standardize_dtype(lp_half.dtype) == "float32"
    lp_half = np.asarray(ops.convert_to_numpy(lp_half))
    np.testing.assert_allclose(np.exp(lp_half).sum(-1), 1.0, atol=1e-4)
    probs_full, probs_half = np.exp(lp_full), np.exp(lp_half)
    assert (
        np.abs(probs_full - probs_half).sum(-1).max() < 0.05
    )  # total variation
    assert np.abs(lp_full - lp_half).mean() < 0.05

    # The loss is float32 and close too.
    loss_full = full.compute_loss(x=x, y=y, y_pred=full(x), sample_weight=sw)
    loss_half = half.compute_loss(x=x, y=y, y_pred=half(x), sample_weight=sw)
    assert keras.backend.standardize_dtype(loss_half.dtype) == "float32"
    np.testing.assert_allclose(float(loss_half), float(loss_full), rtol=1e-2)

    half.compile(optimizer=keras.optimizers.AdamW(1e-2))
    history = half.fit(corpus, batch_size=8, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    # bf16: cached and uncached passes may round apart, so no argmax check.
    text = half.generate("The cell", max_length=10)
    assert isinstance(text, str) and text.startswith("The cell")


@pytest.mark.parametrize("family", ["mhf", "standard"])
def test_a_bfloat16_preset_reloads_in_bfloat16(
    tmp_path, small_tokenizer, family
):
    """KerasHub would cast a preset saved in bfloat16 to Keras' float32
    policy; ours reload as saved (task and backbone), bit for bit, and
    `dtype=` still chooses."""
    if family == "mhf":
        lm = MultiHashFormerCausalLM.from_tokenizer(
            small_tokenizer, "tiny_h3b64", sequence_length=8, dtype="bfloat16"
        )
        task, backbone = MultiHashFormerCausalLM, MultiHashFormerBackbone
    else:
        lm = standard_causal_lm(
            small_tokenizer, "tiny", sequence_length=8, dtype="bfloat16"
        )
        task, backbone = StandardCausalLM, StandardBackbone
    lm.save_to_preset(str(tmp_path))
    again = task.from_preset(str(tmp_path))
    assert again.backbone.dtype_policy.name == "bfloat16"
    for a, b in zip(lm.backbone.weights, again.backbone.weights):
        assert keras.backend.standardize_dtype(b.dtype) == (
            keras.backend.standardize_dtype(a.dtype)
        )
        np.testing.assert_array_equal(
            ops.convert_to_numpy(ops.cast(a, "float32")),
            ops.convert_to_numpy(ops.cast(b, "float32")),
        )
    assert backbone.from_preset(str(tmp_path)).dtype_policy.name == "bfloat16"
    cast = task.from_preset(str(tmp_path), dtype="float32")
    assert cast.backbone.dtype_policy.name == "float32"
    keras.config.set_dtype_policy("float16")  # a global choice is honoured
    try:
        assert task.from_preset(str(tmp_path)).backbone.dtype_policy.name == (
            "float16"
        )
    finally:
        keras.config.set_dtype_policy("float32")
