"""Training precision (issue #39, item 3): `precision="bfloat16"` keeps the
weights and the AdamW state in bf16 as the authors trained, with the loss
in float32; `"mixed_bfloat16"` computes in bf16 over float32 weights. Both
train to finite losses close to float32's on every backend, the precision
is one of the settings a resumed run must keep, and runs of 0.1 (which
recorded `mixed_precision`) still resume."""

import json
import os

import keras
import numpy as np
import pytest

from keras_mhf.pretraining import RunConfigError
from keras_mhf.pretraining import pretrain
from tests.pretraining_helpers import RUN
from tests.pretraining_helpers import compile_once_fixture  # noqa: F401
from tests.pretraining_helpers import corpus_fixture  # noqa: F401

pytestmark = pytest.mark.filterwarnings(
    "ignore:The scoring temperature was not calibrated:UserWarning"
)

SETTINGS = dict(RUN, steps=6, checkpoint_every=3, learning_rate=2e-3)


def losses(output):
    """The training losses of the run's log, in order."""
    with open(os.path.join(output, "log.csv")) as f:
        header, *rows = [line.strip().split(",") for line in f if line.strip()]
    column = header.index("train_loss")
    return [float(row[column]) for row in rows]


@pytest.fixture(scope="module")
def float32_run(corpus, tmp_path_factory):
    prepared, tokenizer = corpus
    output = str(tmp_path_factory.mktemp("float32"))
    pretrain(prepared, output, tokenizer=tokenizer, **SETTINGS)
    return output


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "bfloat16"])
def test_bf16_trains_close_to_float32(corpus, float32_run, tmp_path, precision):
    prepared, tokenizer = corpus
    output = str(tmp_path / precision)
    lm, summary = pretrain(
        prepared, output, tokenizer=tokenizer, precision=precision, **SETTINGS
    )
    assert keras.config.dtype_policy().name == "float32"  # restored
    found, expected = losses(output), losses(float32_run)
    assert len(found) == len(expected) and np.all(np.isfinite(found))
    # bf16 keeps 8 bits of mantissa: the curves agree to a few percent.
    np.testing.assert_allclose(found, expected, rtol=0.03)
    weights = {
        w.path: w.dtype for w in lm.trainable_weights if "float" in w.dtype
    }
    slots = {v.dtype for v in lm.optimizer.variables if "float" in v.dtype}
    if precision == "bfloat16":
        assert set(weights.values()) == {"bfloat16"}, weights
        # Adam's moments follow the weights; the step counter is an int.
        assert "bfloat16" in slots and "float32" not in slots - {"float32"}
    else:
        assert set(weights.values()) == {"float32"}, weights
    assert summary["status"] == "finished"


def test_precision_is_a_setting_of_the_run(corpus, float32_run, tmp_path):
    """A finished float32 run cannot be resumed in bf16; a run.json of 0.1
    (`mixed_precision: false`) is read as float32."""
    prepared, tokenizer = corpus
    with pytest.raises(RunConfigError, match="precision"):
        pretrain(
            prepared,
            float32_run,
            tokenizer=tokenizer,
            precision="bfloat16",
            **SETTINGS,
        )
    output = tmp_path / "old"
    output.mkdir()
    run_json = json.loads(open(os.path.join(float32_run, "run.json")).read())
    settings = dict(run_json["settings"])
    settings["mixed_precision"] = settings.pop("precision") != "float32"
    (output / "run.json").write_text(json.dumps({"settings": settings}))
    pretrain(prepared, str(output), tokenizer=tokenizer, **SETTINGS)
    with pytest.raises(RunConfigError, match="precision"):
        pretrain(
            prepared,
            str(output),
            tokenizer=tokenizer,
            precision="mixed_bfloat16",
            **SETTINGS,
        )


def test_an_unknown_precision_is_refused(corpus, tmp_path):
    """Refused before anything is written: an unknown precision, and Keras'
    AdamW on bf16 weights (it would never change them)."""
    prepared, tokenizer = corpus
    with pytest.raises(
        RunConfigError,
        match="--precision must be 'float32', 'mixed_bfloat16' or",
    ):
        pretrain(prepared, str(tmp_path), tokenizer=tokenizer, precision="fp8")
    with pytest.raises(RunConfigError, match="'keras_adamw' cannot train"):
        pretrain(
            prepared,
            str(tmp_path),
            tokenizer=tokenizer,
            precision="bfloat16",
            optimizer="keras_adamw",
        )
    assert not os.listdir(tmp_path)
