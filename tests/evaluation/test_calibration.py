import os

import keras
import keras_hub
import numpy as np
import pytest
from keras import ops

from keras_mhf.evaluation import calibrate
from keras_mhf.evaluation import calibration
from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerCausalLMPreprocessor
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models.next_token_scorer import TARGET_LOSSES
from keras_mhf.models.next_token_scorer import NextTokenScorer
from keras_mhf.models.next_token_scorer import built_scorer


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x), "float32")


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def trained_lm(corpus):
    """A tiny MHF trained long enough to be over-confident."""
    from keras_mhf.models import MultiHashFormerTokenizer
    from tests.conftest import small_proto_bytes

    keras.utils.set_random_seed(0)
    tokenizer = MultiHashFormerTokenizer(small_proto_bytes())
    lm = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b64", sequence_length=16
    )
    lm.compile(optimizer=keras.optimizers.AdamW(2e-2))
    lm.fit(corpus, batch_size=8, epochs=12, verbose=0)
    return lm


def test_score_is_log_softmax_of_scaled_raw_sums(tiny_lm, corpus):
    x, _, _ = tiny_lm.preprocessor(corpus[:2])
    ids = to_numpy(x["token_ids"]).astype("int32")
    mask = to_numpy(x["padding_mask"]).astype("int32")
    hidden = tiny_lm.backbone({"token_ids": ids, "padding_mask": mask})
    raw = to_numpy(tiny_lm.token_scores(hidden))
    paper = to_numpy(tiny_lm.score(ids, mask))
    np.testing.assert_allclose(paper, log_softmax(raw), atol=1e-5)
    # The compiled scorers take the temperature as an input: after a change
    # they run the same program and give the new numbers.
    scorer = NextTokenScorer.for_model(tiny_lm)

    def compiled_scores():
        picked, _, best = scorer(ids, mask)
        loss = to_numpy(
            tiny_lm.score(ids, mask, scoring_mode="loss", target_ids=ids)
        )
        return picked, best, loss

    programs = []
    for tau in (1.0, 2.5):
        tiny_lm.scoring_temperature = tau
        picked, best, loss = compiled_scores()
        programs.append(
            [
                NextTokenScorer.cached(tiny_lm, 8).model,
                built_scorer(tiny_lm, TARGET_LOSSES),
            ]
        )
        expected = log_softmax(raw / tau)
        on_next = np.take_along_axis(expected[:, :-1], ids[:, 1:, None], -1)
        on_next = on_next[..., 0]
        real = mask[:, 1:] > 0
        np.testing.assert_allclose(picked[real], on_next[real], atol=1e-5)
        top = expected.max(-1)[:, :-1]
        np.testing.assert_allclose(best[real], top[real], atol=1e-5)
        on_same = np.take_along_axis(expected, ids[..., None], -1)[..., 0]
        np.testing.assert_allclose(loss, -on_same, atol=1e-5)
    assert programs[0] == programs[1] and programs[0][0] is scorer.model
    scaled = to_numpy(tiny_lm.score(ids, mask))
    np.testing.assert_allclose(scaled, log_softmax(raw / 2.5), atol=1e-5)
    # Generation sees the same distribution (every sampler reads it).
    _, cache = tiny_lm._build_cache(ids)
    step, _, _ = tiny_lm.call_with_cache(ids[:, :1], ops.zeros_like(cache), 0)
    np.testing.assert_allclose(to_numpy(step)[:, 0], scaled[:, 0], atol=1e-5)


def test_fit_temperature_is_the_exact_minimiser():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(300, 50)).astype("float32") * 6.0
    # Targets drawn at temperature 2.5: the optimum is near it.
    probs = np.exp(log_softmax(scores / 2.5))
    targets = np.array([rng.choice(50, p=p / p.sum()) for p in probs])
    tau = calibration.fit_temperature(scores, targets)
    assert 1.5 < tau < 4.0
    grid = np.exp(np.linspace(np.log(tau) - 0.05, np.log(tau) + 0.05, 201))
    nll = [calibration.metrics_at(scores, targets, t)["loss"] for t in grid]
    best = grid[int(np.argmin(nll))]
    assert abs(np.log(best) - np.log(tau)) < 1e-3
    _, derivative, _ = calibration._softmax_moments(scores, targets, 1.0 / tau)
    assert abs(derivative) < 1e-6


def test_uninformative_scores_hit_the_upper_bound():
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(200, 20)).astype("float32")
    targets = rng.integers(0, 20, size=200)
    tau = calibration.fit_temperature(scores, targets)
    assert tau <= calibration.MAX_TEMPERATURE and np.isfinite(tau)


def test_expected_calibration_error_by_hand():
    confidence = np.array([0.95, 0.95, 0.05, 0.55])
    correct = np.array([True, False, False, True])
    # Bins: [0.9, 0.97): acc 0.5 conf 0.95 (2 of 4); [0, 0.07): acc 0 conf
    # 0.05; [0.53, 0.6): acc 1 conf 0.55.
    expected = (2 * 0.45 + 1 * 0.05 + 1 * 0.45) / 4
    np.testing.assert_allclose(
        calibration.expected_calibration_error(confidence, correct), expected
    )


def test_calibration_lowers_held_out_nll_and_keeps_greedy(trained_lm, corpus):
    held_out = corpus[:16]
    trained_lm.compile(sampler="greedy")
    before = trained_lm.generate(["The cell", "Water boils"], max_length=12)
    report = calibrate(trained_lm, held_out, sequence_length=16)
    assert report["tokens"] >= 100
    assert trained_lm.scoring_temperature == report["temperature"]
    assert report["previous_temperature"] == 1.0
    assert report["after"]["loss"] < report["before"]["loss"] - 1e-4
    assert report["after"]["accuracy"] == report["before"]["accuracy"]
    after = trained_lm.generate(["The cell", "Water boils"], max_length=12)
    assert after == before
    # A second fit from the calibrated model finds the same temperature.
    again = calibrate(trained_lm, held_out, sequence_length=16)
    np.testing.assert_allclose(
        again["temperature"], report["temperature"], 1e-6
    )
    trained_lm.scoring_temperature = 1.0


def test_temperature_survives_keras_and_preset_round_trips(tiny_lm, tmp_path):
    tiny_lm.scoring_temperature = 3.25
    ids = np.array([[1, 5, 6, 7]], "int32")
    expected = to_numpy(tiny_lm.score(ids))
    tiny_lm.save(str(tmp_path / "lm.keras"))
    tiny_lm.save_to_preset(str(tmp_path / "preset"))
    for restored in (
        keras.saving.load_model(str(tmp_path / "lm.keras")),
        MultiHashFormerCausalLM.from_preset(str(tmp_path / "preset")),
        keras_hub.models.CausalLM.from_preset(str(tmp_path / "preset")),
    ):
        assert restored.scoring_temperature == 3.25
        np.testing.assert_allclose(
            to_numpy(restored.score(ids)), expected, atol=1e-5
        )


@pytest.mark.parametrize(
    "value", [0.0, -1.0, float("nan"), float("inf"), "hot"]
)
def test_bad_temperatures_are_refused(tiny_lm, value):
    with pytest.raises(ValueError, match="scoring_temperature"):
        MultiHashFormerCausalLM(tiny_lm.backbone, scoring_temperature=value)
    with pytest.raises(ValueError, match="scoring_temperature"):
        tiny_lm.scoring_temperature = value
    config = tiny_lm.get_config()
    config["scoring_temperature"] = value
    with pytest.raises(ValueError, match="scoring_temperature"):
        MultiHashFormerCausalLM.from_config(config)


def test_bad_calibration_data_is_refused(tiny_lm, tmp_path, mistral_model_path):
    with pytest.raises(ValueError, match="at least 100"):
        calibrate(tiny_lm, ["The cell is small."], sequence_length=8)
    with pytest.raises(ValueError, match="Not enough held-out text|empty"):
        calibrate(tiny_lm, [""], sequence_length=8)
    with pytest.raises(ValueError, match="must be a path"):
        calibrate(tiny_lm, 12345)
    with pytest.raises(FileNotFoundError):
        calibrate(tiny_lm, str(tmp_path / "missing.txt"))
    tiny_lm.preprocessor = MultiHashFormerCausalLMPreprocessor(
        MultiHashFormerTokenizer(mistral_model_path), sequence_length=16
    )
    with pytest.raises(ValueError, match="tokenizer has 32768 tokens"):
        calibrate(tiny_lm, ["The cell is the basic unit of life."] * 50)
    assert not os.path.exists(tmp_path / "missing.txt")


def test_perplexity_reports_the_paper_rule_and_the_calibrated_one(tiny_lm):
    from keras_mhf import evaluation

    blocks = np.random.default_rng(0).integers(3, 120, size=(4, 17))
    plain = evaluation.perplexity(tiny_lm, blocks)
    assert "paper_rule" not in plain and 0.0 <= plain["ece"] <= 1.0
    tiny_lm.scoring_temperature = 2.0
    both = evaluation.perplexity(tiny_lm, blocks)
    assert both["scoring_temperature"] == 2.0
    assert tiny_lm.scoring_temperature == 2.0  # restored after the paper pass
    np.testing.assert_allclose(both["paper_rule"]["loss"], plain["loss"], 1e-6)
    assert both["accuracy"] == plain["accuracy"]
    assert both["loss"] != plain["loss"]
