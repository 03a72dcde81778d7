import os
from unittest import mock

import keras
import keras_hub
import numpy as np
import pytest
from keras import ops
from keras_hub.src.tests.test_case import TestCase

from keras_mhf import SignatureTable
from keras_mhf.models import MultiHashFormerBackbone
from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerCausalLMPreprocessor
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models.multi_hash_former import multi_hash_former_decoding
from keras_mhf.utils.keras_utils import count_trainable_parameters
from tests.conftest import assert_greedy_continuation
from tests.conftest import small_proto_bytes


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


class MultiHashFormerCausalLMTest(TestCase):
    def setUp(self):
        tokenizer = MultiHashFormerTokenizer(small_proto_bytes())
        self.preprocessor = MultiHashFormerCausalLMPreprocessor(
            tokenizer, sequence_length=8
        )
        table = SignatureTable.from_tokens(
            tokenizer.get_vocabulary(),
            3,
            32,
            pad_token_id=tokenizer.signature_pad_token_id,
        )
        self.backbone = MultiHashFormerBackbone(
            vocabulary_size=tokenizer.vocabulary_size(),
            num_hashes=3,
            num_buckets=32,
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            hidden_dim=16,
            intermediate_dim=32,
            gate_dim=8,
            mixer_dim=8,
            pad_token_id=tokenizer.signature_pad_token_id,
            signatures=table,
        )
        self.init_kwargs = {
            "preprocessor": self.preprocessor,
            "backbone": self.backbone,
        }
        self.train_data = (
            ["The cell is the basic unit", "Water boils at one hundred"],
        )
        self.input_data = self.preprocessor(*self.train_data)[0]

    def test_causal_lm_basics(self):
        self.run_task_test(
            cls=MultiHashFormerCausalLM,
            init_kwargs=self.init_kwargs,
            train_data=self.train_data,
            expected_output_shape=(2, 8, 3, 32),  # bucket logits [b, s, H, B]
        )

    def test_saving(self):
        self.run_model_saving_test(
            cls=MultiHashFormerCausalLM,
            init_kwargs=self.init_kwargs,
            input_data=self.input_data,
        )


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
        tiny_lm.score(
            x["token_ids"], x["padding_mask"], scoring_mode="loss", target_ids=y
        )
    )
    expected = -np.take_along_axis(log_probs, to_numpy(y)[..., None], -1)[
        ..., 0
    ]
    np.testing.assert_allclose(per_token, expected, atol=1e-5)
    # The loss scan runs compiled; on TensorFlow under XLA.
    from keras_mhf.models.next_token_scorer import TARGET_LOSSES
    from keras_mhf.models.next_token_scorer import built_scorer

    scorer = built_scorer(tiny_lm, TARGET_LOSSES)
    assert scorer.jit_compile == (keras.config.backend() != "torch")
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
        step, _, cache = tiny_lm.call_with_cache(
            ids[:, index : index + 1], cache, index
        )
        np.testing.assert_allclose(
            to_numpy(step)[:, 0], full[:, index], atol=1e-4
        )


@pytest.mark.parametrize(
    "sampler",
    [
        "greedy",
        "top_k",
        "top_p",
        "random",
        keras_hub.samplers.BeamSampler(num_beams=2),
        keras_hub.samplers.ContrastiveSampler(),
    ],
    ids=["greedy", "top_k", "top_p", "random", "beam", "contrastive"],
)
def test_generate_with_every_sampler(tiny_lm, sampler):
    tiny_lm.compile(sampler=sampler)
    out = tiny_lm.generate(["The cell", "Water boils"], max_length=12)
    assert len(out) == 2 and all(isinstance(t, str) for t in out)


def test_greedy_generation_matches_uncached_argmax(tiny_lm):
    tiny_lm.compile(sampler="greedy")
    prompt = tiny_lm.preprocessor.generate_preprocess(
        ["The cell"], sequence_length=10
    )
    tiny_lm.preprocessor = None  # generate on token ids
    out = tiny_lm.generate(prompt, stop_token_ids=None)
    ids = to_numpy(out["token_ids"])[0]
    start = int(to_numpy(prompt["padding_mask"])[0].sum())
    # One uncached causal pass over the generated row: its log-probs at
    # position p - 1 are those of the prefix ids[:p] (one compiled shape,
    # not one per prefix length).
    log_probs = to_numpy(tiny_lm.score(ids[None]))[0]
    for position in range(start, 10):
        assert ids[position] == int(np.argmax(log_probs[position - 1]))


def test_generate_stops_at_end_token(tiny_lm):
    """KerasHub's loop (top-p) and the exact greedy / top-k loop both stop
    at the end token."""

    end = tiny_lm.preprocessor.tokenizer.end_token_id
    assert tiny_lm.backbone.vocabulary_size > end

    def forced_log_probs(*args, **kwargs):
        log_probs, hidden, cache = call_with_cache(*args, **kwargs)
        forced = np.full(log_probs.shape, -1e9, "float32")
        forced[..., end] = 0.0
        return ops.convert_to_tensor(forced), hidden, cache

    def forced_token(causal_lm, hidden_states, sampler, k, scan_only=None):
        batch = ops.shape(hidden_states)[0]
        return ops.full((batch,), end, "int32"), ops.convert_to_tensor(0)

    call_with_cache = tiny_lm.call_with_cache
    tiny_lm.compile(sampler="top_p")
    with mock.patch.object(tiny_lm, "call_with_cache", wraps=forced_log_probs):
        out = tiny_lm.generate(["The cell"], max_length=12)
    # The first new token is the end token, so nothing is added.
    assert out[0] == "The cell"
    tiny_lm.compile(sampler="greedy")
    with mock.patch.object(
        multi_hash_former_decoding, "next_token", forced_token
    ):
        out = tiny_lm.generate(["The cell"], max_length=12)
    assert out[0] == "The cell"


def test_keras_save_and_load(tiny_lm, corpus, tmp_path):
    x, _, _ = tiny_lm.preprocessor(corpus[:2])
    path = str(tmp_path / "lm.keras")
    tiny_lm.save(path)
    restored = keras.saving.load_model(path)
    assert isinstance(restored, MultiHashFormerCausalLM)
    np.testing.assert_allclose(
        to_numpy(restored(x)), to_numpy(tiny_lm(x)), atol=1e-5
    )
    assert_greedy_continuation(restored)


def test_preset_round_trip(tiny_lm, corpus, tmp_path):
    x, _, _ = tiny_lm.preprocessor(corpus[:2])
    preset = str(tmp_path / "preset")
    tiny_lm.save_to_preset(preset)
    # The cascade decoder lives in the backbone: model.weights.h5 holds the
    # whole model and there is no separate task.weights.h5 to lose.
    assert not tiny_lm.has_task_weights()
    assert not os.path.exists(os.path.join(preset, "task.weights.h5"))
    for cls in (MultiHashFormerCausalLM, keras_hub.models.CausalLM):
        restored = cls.from_preset(preset)
        assert isinstance(restored, MultiHashFormerCausalLM)
        np.testing.assert_allclose(
            to_numpy(restored(x)), to_numpy(tiny_lm(x)), atol=1e-5
        )


def test_preset_without_task_json_loads_the_whole_model_on_request(
    tiny_lm, corpus, tmp_path
):
    """Without task.json a preset is refused (its scoring temperature would
    be lost; tests/models/test_preset_consistency.py); loaded with an
    explicit temperature, KerasHub rebuilds the task from the backbone and
    preprocessor files and every weight still comes from the preset."""
    x, _, _ = tiny_lm.preprocessor(corpus[:2])
    preset = tmp_path / "preset"
    tiny_lm.save_to_preset(str(preset))
    (preset / "task.json").unlink()
    restored = MultiHashFormerCausalLM.from_preset(
        str(preset), scoring_temperature=1.0
    )
    np.testing.assert_allclose(
        to_numpy(restored(x)), to_numpy(tiny_lm(x)), atol=1e-5
    )


@pytest.mark.parametrize("damage", ["missing", "truncated", "garbage"])
def test_damaged_preset_weights_are_refused(tiny_lm, tmp_path, damage):
    preset = tmp_path / "preset"
    tiny_lm.save_to_preset(str(preset))
    weights = preset / "model.weights.h5"
    if damage == "missing":
        weights.unlink()
    elif damage == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_bytes(b"not an h5 file" * 100)
    for cls in (MultiHashFormerCausalLM, keras_hub.models.CausalLM):
        with pytest.raises(
            (ValueError, FileNotFoundError), match="model.weights"
        ):
            cls.from_preset(str(preset))


def test_preset_of_another_architecture_is_refused(
    tiny_lm, small_tokenizer, tmp_path
):
    """Weights that do not fit the config are an error, never a partial load."""
    preset = tmp_path / "preset"
    tiny_lm.save_to_preset(str(preset))
    other = MultiHashFormerCausalLM.from_tokenizer(
        small_tokenizer, "tiny_h4b64"
    )
    other.save_to_preset(str(tmp_path / "other"))
    (preset / "model.weights.h5").write_bytes(
        (tmp_path / "other" / "model.weights.h5").read_bytes()
    )
    with pytest.raises(ValueError, match="model.weights.h5"):
        MultiHashFormerCausalLM.from_preset(str(preset))


def test_mismatched_tokenizer_is_refused(
    tiny_lm, small_proto, mistral_model_path
):
    wrong = keras_hub.models.CausalLMPreprocessor  # noqa: F841 (documented API)
    lm = MultiHashFormerCausalLM(
        tiny_lm.backbone,
        type(tiny_lm.preprocessor)(
            MultiHashFormerTokenizer(mistral_model_path)
        ),
    )
    with pytest.raises(ValueError, match="tokenizer has 32768 tokens"):
        lm.generate("The cell", max_length=8)


def test_tokenizer_with_same_size_but_other_pieces_is_refused(
    tiny_lm, small_proto
):
    tokenizer = MultiHashFormerTokenizer(small_proto)
    vocabulary = tokenizer.get_vocabulary()
    swapped = list(vocabulary)
    swapped[10], swapped[11] = swapped[11], swapped[10]
    with mock.patch.object(tokenizer, "get_vocabulary", return_value=swapped):
        lm = MultiHashFormerCausalLM(
            tiny_lm.backbone, type(tiny_lm.preprocessor)(tokenizer)
        )
        with pytest.raises(ValueError, match="hash differently"):
            lm.score(np.array([[1, 5, 6]]))


def test_out_of_range_ids_are_refused_at_every_entry_point(tiny_lm):
    with pytest.raises(ValueError, match="out-of-range"):
        tiny_lm.score(np.array([[1, 5, 10_000]]))
    with pytest.raises(ValueError, match="Target ids must be in"):
        tiny_lm.score(
            np.array([[1, 5]]),
            scoring_mode="loss",
            target_ids=np.array([[5, -1]]),
        )
    tiny_lm.preprocessor = None
    prompt = {
        "token_ids": np.array([[1, 5, 500, 0]]),
        "padding_mask": np.array([[1, 1, 1, 0]], bool),
    }
    with pytest.raises(ValueError, match="out-of-range"):
        tiny_lm.generate(prompt, stop_token_ids=None)


def test_out_of_range_ids_in_fit_are_refused_before_training(tiny_lm):
    """The check runs before the trainer touches any state: the model is
    unchanged and still usable afterwards (JAX used to leave variables
    unset after an error inside its training loop)."""
    tiny_lm.compile(optimizer=keras.optimizers.SGD(0.1))
    tiny_lm.preprocessor = None
    ids = np.full((2, 9), 5, "int32")
    before = [to_numpy(w).copy() for w in tiny_lm.weights]
    bad = ids.copy()
    bad[1, 4] = 10_000
    for x_ids, y_ids in ((bad[:, :-1], ids[:, 1:]), (ids[:, :-1], bad[:, 1:])):
        with pytest.raises(ValueError, match="out-of-range"):
            tiny_lm.fit(
                {"token_ids": x_ids, "padding_mask": np.ones((2, 8), "int32")},
                y_ids,
                epochs=1,
                verbose=0,
            )
    for a, b in zip(before, tiny_lm.weights):
        np.testing.assert_array_equal(a, to_numpy(b))
    history = tiny_lm.fit(
        {"token_ids": ids[:, :-1], "padding_mask": np.ones((2, 8), "int32")},
        ids[:, 1:],
        epochs=1,
        verbose=0,
    )
    assert np.isfinite(history.history["loss"][0])


def test_attached_tokenizer_is_checked_whenever_it_changes(
    tiny_lm, mistral_model_path
):
    """A new preprocessor with another tokenizer is checked on the next call,
    not only the first time the model is used."""
    tiny_lm.score(np.array([[1, 5, 6]]))  # the original tokenizer passes
    tiny_lm.preprocessor = MultiHashFormerCausalLMPreprocessor(
        MultiHashFormerTokenizer(mistral_model_path), sequence_length=16
    )
    with pytest.raises(ValueError, match="tokenizer has 32768 tokens"):
        tiny_lm.score(np.array([[1, 5, 6]]))


def test_loss_and_metrics_see_target_signatures(tiny_lm, corpus):
    """`compute_loss` maps the token targets to signatures `[b, s, H]` and
    records them for `compute_metrics` of the same step, which takes them
    (`MultiHashFormerCausalLM.step_signatures`)."""
    seen = []

    class FirstHeadAccuracy(keras.metrics.Metric):
        def __init__(self, **kwargs):
            super().__init__(name="first_head_accuracy", **kwargs)
            self.total = self.add_variable(
                (), initializer="zeros", name="total"
            )
            self.count = self.add_variable(
                (), initializer="zeros", name="count"
            )

        def update_state(self, y_true, y_pred, sample_weight=None):
            seen.append(tuple(y_true.shape))
            hit = ops.cast(
                ops.argmax(y_pred[..., 0, :], axis=-1) == y_true[..., 0],
                "float32",
            )
            self.total.assign_add(ops.sum(hit))
            self.count.assign_add(ops.cast(ops.size(hit), "float32"))

        def result(self):
            return self.total / ops.maximum(self.count, 1.0)

    tiny_lm.compile(
        optimizer=keras.optimizers.AdamW(1e-2), metrics=[FirstHeadAccuracy()]
    )
    history = tiny_lm.fit(corpus[:8], batch_size=4, epochs=1, verbose=0)
    assert 0.0 <= history.history["first_head_accuracy"][0] <= 1.0
    assert seen and all(shape[-1] == 3 for shape in seen)  # H = 3 heads
    assert not tiny_lm.step_signatures.pending


def test_expand_vocabulary_adds_no_parameters(tiny_lm, corpus):
    old_vocabulary = tiny_lm.preprocessor.tokenizer.get_vocabulary()
    x, _, _ = tiny_lm.preprocessor(corpus[:2])
    before = to_numpy(tiny_lm.score(x["token_ids"]))
    grown = tiny_lm.expand_vocabulary(
        new_tokens=["▁photosynthesis", "▁mitochondrion", "猫"]
    )
    assert grown.backbone.vocabulary_size == len(old_vocabulary) + 3
    assert (
        # Int table rows and their inverted-index entries only.
        grown.count_params() - tiny_lm.count_params() == 3 * 3 + 3 * 3
    )
    assert count_trainable_parameters(grown) == count_trainable_parameters(
        tiny_lm
    )
    old_rows = grown.backbone.signature_lookup.get_signatures()[
        : len(old_vocabulary)
    ]
    np.testing.assert_array_equal(
        old_rows, tiny_lm.backbone.signature_lookup.get_signatures()
    )
    # Old tokens keep their unnormalised scores: the bucket logits are equal.
    np.testing.assert_allclose(
        to_numpy(grown(x)), to_numpy(tiny_lm(x)), atol=1e-6
    )
    after = to_numpy(grown.score(x["token_ids"]))
    assert after.shape[-1] == len(old_vocabulary) + 3
    # Renormalised over the larger vocabulary, old tokens' ranks are kept.
    np.testing.assert_array_equal(
        np.argsort(after[..., : len(old_vocabulary)], -1)[..., -5:],
        np.argsort(before, -1)[..., -5:],
    )


def test_misspelt_and_impossible_arguments_are_refused(
    small_tokenizer, tiny_lm
):
    with pytest.raises(TypeError, match="did you mean 'num_hashes'"):
        MultiHashFormerCausalLM.from_tokenizer(
            small_tokenizer, "tiny_h3b64", num_hash=3
        )
    with pytest.raises(TypeError, match="unknown argument"):
        MultiHashFormerCausalLM(tiny_lm.backbone, scoring_temprature=2.0)
    with pytest.raises(ValueError, match="int32"):
        MultiHashFormerCausalLM.from_tokenizer(
            small_tokenizer, "tiny_h3b64", num_buckets=2**31 + 5
        )
    with pytest.raises(ValueError, match="must be >= 1"):
        MultiHashFormerCausalLM.from_tokenizer(
            small_tokenizer, "tiny_h3b64", num_layers=0
        )
    with pytest.raises(ValueError, match="single string"):
        tiny_lm.expand_vocabulary(new_tokens="ΩЖ")
    with pytest.raises(ValueError, match="not valid Unicode text"):
        tiny_lm.expand_vocabulary(new_tokens=["\ud800"])


@pytest.mark.parametrize("bad_batch", [0, 2])
def test_a_failing_dataset_leaves_a_usable_model(tiny_lm, bad_batch):
    """A streamed batch with an out-of-range id stops `fit` with a clear
    error (for the first batch too, which Keras would otherwise report as
    "ran out of data"), and the model stays usable."""
    import tensorflow as tf

    tiny_lm.compile(optimizer=keras.optimizers.SGD(0.1))
    tiny_lm.preprocessor = None
    ids = np.full((8, 9), 5, "int32")
    ids[2 * bad_batch, 3] = 10_000  # batch `bad_batch` of size 2
    dataset = tf.data.Dataset.from_tensor_slices(
        (
            {
                "token_ids": ids[:, :-1],
                "padding_mask": np.ones((8, 8), "int32"),
            },
            ids[:, 1:],
        )
    ).batch(2)
    with pytest.raises(Exception, match="vocabulary_size"):
        tiny_lm.fit(dataset, epochs=1, verbose=0)
    values = [to_numpy(w) for w in tiny_lm.weights]
    assert all(v is not None and np.all(np.isfinite(v)) for v in values)
    assert np.all(np.isfinite(to_numpy(tiny_lm.score(np.array([[1, 5, 6]])))))
    ids[ids >= 10_000] = 5
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((8, 8), "int32")}
    history = tiny_lm.fit(x, ids[:, 1:], batch_size=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
