"""Per-step TensorBoard curves of a run, read with TensorBoard's own reader."""

import glob
import os

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

from keras_mhf.cli import pretrain as pretrain_command
from keras_mhf.cli.common import run_settings_from
from keras_mhf.pretraining import RunConfig
from keras_mhf.pretraining import hooks
from keras_mhf.pretraining import pretrain
from keras_mhf.pretraining.config import tensorboard_directory
from keras_mhf.pretraining.logs import read_log
from keras_mhf.pretraining.training_curves import _read_events
from tests.pretraining_helpers import RUN
from tests.pretraining_helpers import compilation_cache
from tests.pretraining_helpers import prepared_corpus

# Points every 2 steps and at each checkpoint (steps 3 and 6).
CURVES_RUN = dict(RUN, steps=6, checkpoint_every=3, log_every=2)
TRAIN = ("train/loss", "train/learning_rate", "train/tokens_per_second")

pytestmark = pytest.mark.filterwarnings(
    "ignore:The scoring temperature was not calibrated:UserWarning"
)


@pytest.fixture(scope="module", autouse=True)
def _compile_once(tmp_path_factory):
    with compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepared_corpus(str(tmp_path_factory.getbasetemp() / "corpus"))


def curves(directory):
    """`{tag: [(step, value), ...]}` as TensorBoard reads the directory."""
    reader = EventAccumulator(str(directory))
    reader.Reload()
    return {
        tag: [(event.step, event.value) for event in reader.Scalars(tag)]
        for tag in reader.Tags()["scalars"]
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
    output = tmp_path_factory.mktemp("curves") / "run"
    _, summary = pretrain(corpus[0], str(output), **CURVES_RUN)
    return output, summary


def test_every_step_of_the_run_is_on_its_curves(uninterrupted):
    output, summary = uninterrupted
    found = curves(output / "tensorboard")
    for tag in TRAIN:
        assert [step for step, _ in found[tag]] == [2, 3, 4, 6], tag
    for tag in ("validation/loss", "validation/perplexity_paper_rule"):
        assert [step for step, _ in found[tag]] == [3, 6], tag
    # A point's loss is the mean over the steps since the previous point:
    # with log.csv's mean over each chunk of 3 steps, (2 p2 + p3) / 3 and
    # (p4 + 2 p6) / 3.
    loss = dict(found["train/loss"])
    rows = read_log(summary["log"])
    np.testing.assert_allclose(
        [(2 * loss[2] + loss[3]) / 3, (loss[4] + 2 * loss[6]) / 3],
        [rows[0]["train_loss"], rows[1]["train_loss"]],
        rtol=1e-5,
    )
    validation = dict(found["validation/loss"])
    np.testing.assert_allclose(
        [validation[3], validation[6]], [r["val_loss"] for r in rows], rtol=1e-6
    )
    # A 1-step warmup from 0, then a cosine decay over the other 5 steps:
    # step t (1-based) uses rate(t - 1).
    rate = dict(found["train/learning_rate"])
    peak = RUN["learning_rate"]
    assert rate[2] == pytest.approx(peak)
    assert rate[3] == pytest.approx(peak * 0.5 * (1 + np.cos(np.pi / 5)))
    assert all(value > 0 for _, value in found["train/tokens_per_second"])


class Crash(Exception):
    pass


def test_a_crashed_and_resumed_run_has_each_step_once(
    tmp_path, corpus, uninterrupted, monkeypatch
):
    """The run fails at step 5, after its checkpoint at 3 and its point at
    4: the rerun drops the point past its checkpoint and writes it again."""
    output = tmp_path / "run"

    def crash(name, **info):
        if name == "train_step" and info["step"] == 5:
            raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(hooks, "event", crash)
        with pytest.raises(Crash):
            pretrain(corpus[0], str(output), **CURVES_RUN)
    written = [
        event.step
        for path in glob.glob(str(output / "tensorboard" / "events.*"))
        for event in _read_events(path)
        if event.HasField("summary")
        and event.summary.value[0].tag == "train/loss"
    ]
    assert sorted(written) == [2, 3, 4]
    _, summary = pretrain(corpus[0], str(output), **CURVES_RUN)
    assert summary["finished"]
    resumed, expected = (
        curves(output / "tensorboard"),
        curves(uninterrupted[0] / "tensorboard"),
    )
    assert sorted(resumed) == sorted(expected)
    for tag, points in expected.items():
        assert [s for s, _ in resumed[tag]] == [s for s, _ in points], tag
        if tag != "train/tokens_per_second":
            np.testing.assert_allclose(
                [v for _, v in resumed[tag]], [v for _, v in points], rtol=1e-6
            )


def test_where_the_curves_go(tmp_path):
    parser = pretrain_command.build_parser()

    def directory(*flags):
        args = parser.parse_args(["--data", "d", "--output", "o", *flags])
        values = run_settings_from(parser, args, "pretrain")
        return tensorboard_directory(RunConfig(**values))

    assert directory() == os.path.abspath("o/tensorboard")
    assert directory("--tensorboard", str(tmp_path)) == str(tmp_path)
    assert directory("--no-tensorboard") is None
