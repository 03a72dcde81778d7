"""Gradient accumulation: `--batch-size` stays the global batch, computed in
`gradient_accumulation_steps` micro-batches per optimizer step."""

import keras
import numpy as np
import pytest

from keras_mhf.data import WindowSampler
from keras_mhf.pretraining import RunConfig
from keras_mhf.pretraining import RunConfigError
from keras_mhf.pretraining import pretrain
from keras_mhf.pretraining.logs import read_log
from tests.pretraining_helpers import CALIBRATED_RUN
from tests.pretraining_helpers import assert_same_state
from tests.pretraining_helpers import compilation_cache
from tests.pretraining_helpers import prepared_corpus
from tests.pretraining_helpers import reference_run
from tests.pretraining_helpers import state_of
from tests.pretraining_helpers import stop_after_chunks

# Each step of 4 windows in 2 micro-batches of 2.
ACCUMULATED = dict(CALIBRATED_RUN, gradient_accumulation_steps=2)


@pytest.fixture(scope="module", autouse=True)
def _compile_once(tmp_path_factory):
    with compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepared_corpus(str(tmp_path_factory.getbasetemp() / "corpus"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of 4 windows per step, shared with
    test_pretraining.py."""
    return reference_run(str(tmp_path_factory.getbasetemp()))


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0
        self.fits = 0

    def on_train_begin(self, logs=None):
        self.fits += 1

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory, corpus):
    """`(lm, summary, counter)` of the run in 2 micro-batches per step."""
    counter = CountBatches()
    output = str(tmp_path_factory.mktemp("accumulated") / "run")
    lm, summary = pretrain(
        corpus[0], output, callbacks=[counter], **ACCUMULATED
    )
    return lm, summary, counter


def test_micro_batches_are_the_step_batch(corpus):
    whole = WindowSampler(corpus[0], "train", 16, 8, seed=3)
    parts = WindowSampler(corpus[0], "train", 16, 8, seed=3, micro_batches=4)
    for step in (0, 5):
        x, y, weight = whole(step)
        pieces = [parts(step * 4 + j) for j in range(4)]
        np.testing.assert_array_equal(
            np.concatenate([p[0]["token_ids"] for p in pieces]),
            x["token_ids"],
        )
        np.testing.assert_array_equal(np.concatenate([p[1] for p in pieces]), y)
    with pytest.raises(ValueError, match="process_count=2 x micro_batches=3"):
        WindowSampler(corpus[0], "train", 16, 8, 0, 0, 2, micro_batches=3)


def test_accumulated_steps_train_as_the_whole_batch(accumulated, reference):
    """One optimizer step of 2 micro-batches of 2 windows is one step of the
    4 windows: the same AdamW update (bias-corrected, with weight decay and
    the learning-rate schedule of optimizer steps) of the clipped mean
    gradient, to float32 rounding, over 4 steps."""
    lm, summary, counter = accumulated
    assert summary["finished"] and summary["step"] == 4
    # `callbacks=` reach `fit`: one call per chunk of 1 step, 2 batches each.
    assert (counter.fits, counter.batches) == (4, 8)
    weights = len(lm.weights)
    for ours, theirs, variable in zip(
        state_of(lm)[:weights], reference[0][:weights], lm.weights
    ):
        if variable.path == "hash_encoder/score_dense/bias":
            # Its gradient is 0 in exact arithmetic (it shifts every hash's
            # gate score alike, which the softmax over hashes ignores), and
            # Adam's m / sqrt(v) turns the rounding noise into steps of
            # either sign: it stays at noise scale in both runs.
            assert np.abs(ours).max() < 1e-4 and np.abs(theirs).max() < 1e-4
            continue
        np.testing.assert_allclose(
            ours, theirs, rtol=1e-4, atol=1e-6, err_msg=variable.path
        )
    log = read_log(summary["log"])
    expected = read_log(f"{reference[1]}/log.csv")
    for column in ("train_loss", "val_loss", "learning_rate"):
        np.testing.assert_allclose(
            [r[column] for r in log], [r[column] for r in expected], rtol=1e-5
        )
    assert [r["tokens"] for r in log] == [r["tokens"] for r in expected]


def test_a_resumed_accumulating_run_ends_with_the_same_weights(
    tmp_path, corpus, accumulated
):
    """Checkpoints fall on optimizer steps (the accumulators are empty
    there): stopped after 2 steps and resumed, the run ends bit for bit
    where the uninterrupted one did."""
    output = str(tmp_path / "run")
    with stop_after_chunks(2):
        _, stopped = pretrain(corpus[0], output, **ACCUMULATED)
    assert stopped["step"] == 2
    lm, summary = pretrain(corpus[0], output, **ACCUMULATED)
    assert summary["finished"]
    assert_same_state(state_of(lm), state_of(accumulated[0]))
    # Another number of micro-batches is another optimizer state: refused.
    with pytest.raises(RunConfigError, match="gradient_accumulation_steps"):
        pretrain(
            corpus[0],
            output,
            **dict(ACCUMULATED, steps=6, gradient_accumulation_steps=4),
        )


def test_a_batch_that_does_not_split_is_refused():
    config = RunConfig("d", "o", batch_size=6, gradient_accumulation_steps=4)
    with pytest.raises(
        RunConfigError,
        match=(
            "--batch-size 6 does not split into --gradient-accumulation-steps 4 "
            "equal micro-batches; use a batch size that is a multiple of 4"
        ),
    ):
        config.validate()
    with pytest.raises(RunConfigError, match="must be an integer >= 1"):
        RunConfig("d", "o", gradient_accumulation_steps=0).validate()
