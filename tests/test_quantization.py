"""`quantize("int8")` / `quantize("int4")` covers the bucket tables: the
quantized model scores close to float32, round-trips through `.keras`,
presets and SavedModel export, and Keras finds nothing in it that it cannot
quantize."""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

from keras_mhf.layers import HashEncoder
from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer
from tests.conftest import small_proto_bytes

# Stated tolerances: total variation between the quantized and the float32
# next-token distributions, and the share of positions with the same argmax.
TOLERANCE = {"int8": (0.02, 0.95), "int4": (0.15, 0.8)}
MHF_LAYERS = (
    "HashEncoder",
    "CascadeHashDecoder",
    "SignatureLookup",
    "MultiHashFormer",
)


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x), "float32")


@pytest.fixture(scope="module")
def trained(corpus):
    keras.utils.set_random_seed(0)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        MultiHashFormerTokenizer(small_proto_bytes()),
        "tiny_h3b256",
        sequence_length=16,
    )
    lm.compile(optimizer=keras.optimizers.AdamW(2e-2))
    lm.fit(corpus, batch_size=8, epochs=6, verbose=0)
    return lm


def quantized_copy(lm, mode, tmp_path):
    path = str(tmp_path / f"float_{mode}.keras")
    lm.save(path)
    copy = keras.saving.load_model(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        copy.quantize(mode)
    ours = [
        str(w.message)
        for w in caught
        if any(name in str(w.message) for name in MHF_LAYERS)
    ]
    assert ours == [], ours
    return copy


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_scores_are_close_and_round_trip(trained, tmp_path, mode):
    ids = (
        np.random.default_rng(0).integers(3, 120, size=(4, 12)).astype("int32")
    )
    ids[:, 0] = 1
    reference = to_numpy(trained.score(ids))
    lm = quantized_copy(trained, mode, tmp_path)
    encoder = lm.backbone.hash_encoder
    assert encoder.quantization_mode == mode
    assert all(
        keras.backend.standardize_dtype(t.dtype) == "int8"
        for t in encoder.embeddings
    )
    quantized = to_numpy(lm.score(ids))
    total_variation = 0.5 * np.abs(np.exp(quantized) - np.exp(reference)).sum(
        -1
    )
    same = (quantized.argmax(-1) == reference.argmax(-1)).mean()
    max_tv, min_same = TOLERANCE[mode]
    assert total_variation.max() < max_tv, total_variation.max()
    assert same >= min_same, same
    # .keras and preset round trips give the same quantized numbers.
    lm.save(str(tmp_path / "q.keras"))
    lm.save_to_preset(str(tmp_path / "preset"))
    for restored in (
        keras.saving.load_model(str(tmp_path / "q.keras")),
        MultiHashFormerCausalLM.from_preset(str(tmp_path / "preset")),
    ):
        assert restored.backbone.hash_encoder.quantization_mode == mode
        np.testing.assert_allclose(
            to_numpy(restored.score(ids)), quantized, atol=1e-6
        )
    # Exact decoding holds on the quantized tables too.
    outputs = {}
    for decoding in ("full", "candidates"):
        lm.decoding = decoding
        lm.compile(sampler="greedy")
        outputs[decoding] = lm.generate(
            ["The cell", "Water boils"], max_length=12
        )
    assert outputs["full"] == outputs["candidates"]


def test_quantized_savedmodel_export(trained, tmp_path):
    import tensorflow as tf

    lm = quantized_copy(trained, "int8", tmp_path)
    ids = np.array([[1, 5, 6, 7, 8]], "int32")
    log_probs = to_numpy(lm.score(ids))[:, -1]
    saved = lm.export(str(tmp_path / "saved"), include_text_endpoints=False)
    reloaded = tf.saved_model.load(saved)  # keep it: it owns the variables
    served = reloaded.serve(
        token_ids=tf.constant(ids), padding_mask=tf.ones_like(ids)
    )["log_probs"].numpy()
    np.testing.assert_allclose(served, log_probs, atol=1e-5)


def test_quantized_tables_match_dequantized_float_tables():
    """Chunked int8 logits and soft retrieval equal the float maths on the
    dequantized tables (several chunks, the last one padded)."""
    from keras_mhf.layers import hash_encoder

    encoder = HashEncoder(2, 4500, 32, gate_dim=8)
    encoder.build()
    encoder.quantize("int8")
    assert encoder._chunk() == hash_encoder.TABLE_CHUNK
    tables = to_numpy(encoder.stacked_embeddings())
    rng = np.random.default_rng(0)
    states = rng.normal(size=(3, 32)).astype("float32")
    probs = np.exp(rng.normal(size=(3, 4500))).astype("float32")
    probs /= probs.sum(-1, keepdims=True)
    for head in range(2):
        np.testing.assert_allclose(
            to_numpy(
                encoder.bucket_logits(ops.convert_to_tensor(states), head)
            ),
            states @ tables[head].T,
            rtol=1e-4,
            atol=1e-5,
        )
        np.testing.assert_allclose(
            to_numpy(
                encoder.soft_embedding(ops.convert_to_tensor(probs), head)
            ),
            probs @ tables[head],
            rtol=1e-4,
            atol=1e-6,
        )
    signatures = np.array([[[1, 4499], [0, 2048]]], "int32")
    np.testing.assert_allclose(
        to_numpy(encoder.lookup(signatures))[0, 0],
        np.stack([tables[0][1], tables[1][4499]]),
        rtol=1e-6,
    )


def test_unsupported_modes_are_refused():
    encoder = HashEncoder(2, 16, 8, gate_dim=8)
    encoder.build()
    with pytest.raises(NotImplementedError, match="int8"):
        encoder.quantize("float8")
