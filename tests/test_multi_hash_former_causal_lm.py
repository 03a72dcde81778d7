import os
from unittest import mock

import keras
import keras_hub
import numpy as np
import pytest
from keras import ops

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


def test_fit_lowers_loss_on_strings(tiny_lm, corpus):
    tiny_lm.compile(optimizer=keras.optimizers.AdamW(1e-2))
    history = tiny_lm.fit(corpus, batch_size=8, epochs=4, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0] - 0.5
    # The loss is the sum over heads: at init it is near H * log(B).
    assert abs(losses[0] - 3 * np.log(64)) < 2.0


def test_training_output_is_bucket_logits(tiny_lm, corpus):
    x, y, sw = tiny_lm.preprocessor(corpus[:2])
    logits = tiny_lm(x)
    assert tuple(logits.shape) == (2, 16, 3, 64)
    # compute_loss maps token targets to signatures inside the model.
    loss = tiny_lm.compute_loss(x=x, y=y, y_pred=logits, sample_weight=sw)
    assert np.isfinite(float(loss))


def test_score_is_normalised_and_matches_loss(tiny_lm, corpus):
    x, y, _ = tiny_lm.preprocessor(corpus[:2])
    log_probs = to_numpy(tiny_lm.score(x["token_ids"], x["padding_mask"]))
    assert log_probs.shape == (2, 16, tiny_lm.backbone.vocabulary_size)
    np.testing.assert_allclose(np.exp(log_probs).sum(-1), 1.0, atol=1e-4)
    per_token = to_numpy(
        tiny_lm.score(x["token_ids"], x["padding_mask"], scoring_mode="loss", target_ids=y)
    )
    expected = -np.take_along_axis(log_probs, to_numpy(y)[..., None], -1)[..., 0]
    np.testing.assert_allclose(per_token, expected, atol=1e-5)
    # The intercept sees the embeddings (-1) and every block.
    seen = []
    tiny_lm.score(
        x["token_ids"], layer_intercept_fn=lambda h, i: seen.append(i) or h
    )
    assert seen == [-1, 0, 1]


def test_cached_forward_equals_full_forward(tiny_lm, corpus):
    x, _, _ = tiny_lm.preprocessor(corpus[:2])
    ids = to_numpy(x["token_ids"])
    full = to_numpy(tiny_lm.score(ids))
    _, cache = tiny_lm._build_cache(ids)
    cache = ops.zeros_like(cache)
    for index in range(ids.shape[1]):
        step, _, cache = tiny_lm.call_with_cache(ids[:, index : index + 1], cache, index)
        np.testing.assert_allclose(to_numpy(step)[:, 0], full[:, index], atol=1e-4)


@pytest.mark.parametrize(
    "sampler",
    ["greedy", "top_k", "top_p", "random", keras_hub.samplers.BeamSampler(num_beams=2),
     keras_hub.samplers.ContrastiveSampler()],
    ids=["greedy", "top_k", "top_p", "random", "beam", "contrastive"],
)
def test_generate_with_every_sampler(tiny_lm, sampler):
    tiny_lm.compile(sampler=sampler)
    out = tiny_lm.generate(["The cell", "Water boils"], max_length=12)
    assert len(out) == 2 and all(isinstance(t, str) for t in out)


def test_greedy_generation_matches_uncached_argmax(tiny_lm):
    tiny_lm.compile(sampler="greedy")
    prompt = tiny_lm.preprocessor.generate_preprocess(["The cell"], sequence_length=10)
    tiny_lm.preprocessor = None  # generate on token ids
    out = tiny_lm.generate(prompt, stop_token_ids=None)
    ids = to_numpy(out["token_ids"])[0]
    start = int(to_numpy(prompt["padding_mask"])[0].sum())
    for position in range(start, 10):
        log_probs = to_numpy(tiny_lm.score(ids[None, :position]))[0, -1]
        assert ids[position] == int(np.argmax(log_probs))


def test_generate_stops_at_end_token(tiny_lm):
    tokenizer = tiny_lm.preprocessor.tokenizer
    end = tokenizer.end_token_id
    vocabulary_size = tiny_lm.backbone.vocabulary_size

    def wrapper(*args, **kwargs):
        log_probs, hidden, cache = call_with_cache(*args, **kwargs)
        forced = np.full(log_probs.shape, -1e9, "float32")
        forced[..., end] = 0.0
        return ops.convert_to_tensor(forced), hidden, cache

    call_with_cache = tiny_lm.call_with_cache
    tiny_lm.compile(sampler="greedy")
    with mock.patch.object(tiny_lm, "call_with_cache", wraps=wrapper):
        out = tiny_lm.generate(["The cell"], max_length=12)
    assert vocabulary_size > end
    # The first new token is the end token, so nothing is added to the prompt.
    assert out[0] == "The cell"


def test_keras_save_and_load(tiny_lm, corpus, tmp_path):
    x, _, _ = tiny_lm.preprocessor(corpus[:2])
    path = str(tmp_path / "lm.keras")
    tiny_lm.save(path)
    restored = keras.saving.load_model(path)
    assert isinstance(restored, MultiHashFormerCausalLM)
    np.testing.assert_allclose(to_numpy(restored(x)), to_numpy(tiny_lm(x)), atol=1e-5)
    assert restored.generate("The cell", max_length=8)


def test_preset_round_trip(tiny_lm, corpus, tmp_path):
    x, _, _ = tiny_lm.preprocessor(corpus[:2])
    preset = str(tmp_path / "preset")
    tiny_lm.save_to_preset(preset)
    assert os.path.exists(os.path.join(preset, "task.weights.h5"))
    for cls in (MultiHashFormerCausalLM, keras_hub.models.CausalLM):
        restored = cls.from_preset(preset)
        assert isinstance(restored, MultiHashFormerCausalLM)
        np.testing.assert_allclose(to_numpy(restored(x)), to_numpy(tiny_lm(x)), atol=1e-5)


def test_mismatched_tokenizer_is_refused(tiny_lm, small_proto, mistral_model_path):
    wrong = keras_hub.models.CausalLMPreprocessor  # noqa: F841 (documented API)
    lm = MultiHashFormerCausalLM(
        tiny_lm.backbone,
        type(tiny_lm.preprocessor)(MultiHashFormerTokenizer(mistral_model_path)),
    )
    with pytest.raises(ValueError, match="tokenizer has 32768 tokens"):
        lm.generate("The cell", max_length=8)


def test_tokenizer_with_same_size_but_other_pieces_is_refused(tiny_lm, small_proto):
    tokenizer = MultiHashFormerTokenizer(small_proto)
    vocabulary = tokenizer.get_vocabulary()
    swapped = list(vocabulary)
    swapped[10], swapped[11] = swapped[11], swapped[10]
    with mock.patch.object(tokenizer, "get_vocabulary", return_value=swapped):
        lm = MultiHashFormerCausalLM(tiny_lm.backbone, type(tiny_lm.preprocessor)(tokenizer))
        with pytest.raises(ValueError, match="hash differently"):
            lm.score(np.array([[1, 5, 6]]))


def test_out_of_range_ids_are_refused(tiny_lm):
    with pytest.raises(ValueError, match="out-of-range"):
        tiny_lm.score(np.array([[1, 5, 10_000]]))


def test_expand_vocabulary_adds_no_parameters(tiny_lm, corpus):
    old_vocabulary = tiny_lm.preprocessor.tokenizer.get_vocabulary()
    x, _, _ = tiny_lm.preprocessor(corpus[:2])
    before = to_numpy(tiny_lm.score(x["token_ids"]))
    grown = tiny_lm.expand_vocabulary(new_tokens=["▁photosynthesis", "▁mitochondrion", "猫"])
    assert grown.backbone.vocabulary_size == len(old_vocabulary) + 3
    assert grown.count_params() - tiny_lm.count_params() == 3 * 3  # int table rows only
    trainable = lambda m: sum(int(np.prod(w.shape)) for w in m.trainable_weights)
    assert trainable(grown) == trainable(tiny_lm)
    old_rows = grown.backbone.signature_lookup.get_signatures()[: len(old_vocabulary)]
    np.testing.assert_array_equal(old_rows, tiny_lm.backbone.signature_lookup.get_signatures())
    # Old tokens keep their unnormalised scores: the bucket logits are equal.
    np.testing.assert_allclose(to_numpy(grown(x)), to_numpy(tiny_lm(x)), atol=1e-6)
    after = to_numpy(grown.score(x["token_ids"]))
    assert after.shape[-1] == len(old_vocabulary) + 3
    # Renormalised over the larger vocabulary, old tokens' ranks are kept.
    np.testing.assert_array_equal(
        np.argsort(after[..., : len(old_vocabulary)], -1)[..., -5:],
        np.argsort(before, -1)[..., -5:],
    )
