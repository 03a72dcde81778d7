"""A first run that reads cleanly (#24, item 5): `log.csv` reports a
validation perplexity that compares across MHF and Standard (MHF
calibrated, the paper's rule beside it), the plots are written, our `fit`
calls raise no Keras `shuffle` or Grain warning, long loops report
progress, and TensorFlow's start-up noise is dropped only where it is
noise."""

import functools
import logging
import math
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

from keras_mhf.pretraining import LOG_FIELDS
from keras_mhf.pretraining import pretrain
from keras_mhf.pretraining.logs import comparable_perplexity
from keras_mhf.pretraining.logs import plot_comparison
from keras_mhf.pretraining.logs import plot_log
from keras_mhf.pretraining.logs import read_log
from keras_mhf.utils import native_logs
from keras_mhf.utils import progress as progress_module
from tests.conftest import CORPUS
from tests.pretraining_helpers import CALIBRATED_RUN
from tests.pretraining_helpers import compile_once_fixture  # noqa: F401
from tests.pretraining_helpers import corpus_fixture  # noqa: F401
from tests.pretraining_helpers import reference_run
from tests.pretraining_helpers import write_tokenizer

NEW_COLUMNS = (
    "val_perplexity_reported",
    "val_perplexity_calibrated",
    "scoring_temperature",
)


class _Records(logging.Handler):
    """Collects the records of a logger (Grain warns through absl's)."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _noisy(caught, records):
    """The Keras `shuffle` and Grain read-ahead warnings among `caught`
    (warnings) and `records` (absl log messages)."""
    found = [str(w.message) for w in caught if "shuffle" in str(w.message)]
    return found + [m for m in records if "prefetch_buffer_size" in m]


@pytest.fixture
def absl_records():
    handler = _Records()
    logger = logging.getLogger("absl")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def standard_run(tmp_path_factory, corpus):
    """`(summary, warnings, absl messages)` of a short Standard run with the
    reference run's validation windows."""
    handler = _Records()
    logging.getLogger("absl").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, summary = pretrain(
                corpus[0],
                str(tmp_path_factory.mktemp("standard")),
                **dict(
                    CALIBRATED_RUN,
                    model="standard",
                    architecture="tiny",
                    steps=2,
                ),
            )
    finally:
        logging.getLogger("absl").removeHandler(handler)
    return summary, caught, handler.messages


def test_mhf_log_reports_the_calibrated_perplexity_beside_the_paper_rule(
    tmp_path_factory,
):
    _, output = reference_run(str(tmp_path_factory.getbasetemp()))
    rows = read_log(os.path.join(output, "log.csv"))
    with open(os.path.join(output, "log.csv")) as f:
        assert f.readline().strip().split(",") == LOG_FIELDS
    assert len(rows) == CALIBRATED_RUN["steps"]
    for row in rows:
        for name in ("val_perplexity",) + NEW_COLUMNS:
            assert row[name] is not None and math.isfinite(row[name]), name
        assert row["scoring_temperature"] > 0
        assert comparable_perplexity(row) == row["val_perplexity_calibrated"]
    # The last row's calibration is the final validation's (same fit
    # windows, same reported windows), up to the scoring path's float32.
    import json

    with open(os.path.join(output, "summary.json")) as f:
        summary = json.load(f)
    last = rows[-1]
    np.testing.assert_allclose(
        last["scoring_temperature"], summary["scoring_temperature"], rtol=1e-6
    )
    np.testing.assert_allclose(
        last["val_perplexity_calibrated"],
        summary["validation"]["perplexity"],
        rtol=1e-4,
    )
    np.testing.assert_allclose(
        last["val_perplexity_reported"],
        summary["validation_paper_rule"]["perplexity"],
        rtol=1e-4,
    )
    assert os.path.exists(os.path.join(output, "loss.png"))


def test_standard_log_leaves_the_calibrated_columns_empty(standard_run):
    summary, _, _ = standard_run
    import csv

    with open(summary["log"], newline="") as f:
        raw = list(csv.DictReader(f))
    assert [r["val_perplexity_calibrated"] for r in raw] == ["", ""]
    assert [r["scoring_temperature"] for r in raw] == ["", ""]
    rows = read_log(summary["log"])
    for row in rows:
        assert math.isfinite(row["val_perplexity_reported"])
        assert comparable_perplexity(row) == row["val_perplexity_reported"]
    np.testing.assert_allclose(
        rows[-1]["val_perplexity_reported"],
        summary["validation"]["perplexity"],
        rtol=1e-4,
    )


def test_pretraining_fit_calls_raise_no_shuffle_or_grain_warning(
    standard_run,
):
    _, caught, records = standard_run
    assert _noisy(caught, records) == []


def test_comparison_plot_and_old_logs(tmp_path, tmp_path_factory, standard_run):
    _, mhf = reference_run(str(tmp_path_factory.getbasetemp()))
    png = plot_comparison(
        {
            "mhf": os.path.join(mhf, "log.csv"),
            "standard": standard_run[0]["log"],
        },
        str(tmp_path / "comparison.png"),
    )
    assert png and os.path.getsize(png) > 0
    # A log written before the new columns still reads and plots.
    old = tmp_path / "old.csv"
    old.write_text(
        "step,tokens,train_loss,val_loss,val_perplexity,val_accuracy,"
        "learning_rate,seconds\n1,64,12.5,4.7,110.0,0.0,0.005,1.0\n"
    )
    (row,) = read_log(str(old))
    assert row["val_perplexity_calibrated"] is None
    assert comparable_perplexity(row) == 110.0
    assert plot_log(str(old), str(tmp_path / "old.png"))


@functools.lru_cache(maxsize=None)
def _tokenizer(path):
    from keras_mhf.models import MultiHashFormerTokenizer

    return MultiHashFormerTokenizer(write_tokenizer(path))


@pytest.mark.parametrize("kind", ["mhf", "standard"])
def test_fit_on_text_raises_no_shuffle_or_grain_warning(
    kind, tmp_path_factory, absl_records
):
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import standard_causal_lm

    tokenizer = _tokenizer(
        str(tmp_path_factory.getbasetemp() / "first_run.model")
    )
    if kind == "mhf":
        lm = MultiHashFormerCausalLM.from_tokenizer(
            tokenizer, "tiny_h3b64", sequence_length=16
        )
    else:
        lm = standard_causal_lm(tokenizer, "tiny", sequence_length=16)
    lm.compile(optimizer=keras.optimizers.AdamW(1e-3))
    texts = list(CORPUS[:8])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm.fit(texts, batch_size=4, epochs=1, verbose=0)
    assert _noisy(caught, absl_records) == []
    # A `shuffle=True` the caller asks for is ignored: that warning stays.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm.fit(texts, batch_size=4, epochs=1, verbose=0, shuffle=True)
    assert any("shuffle" in str(w.message) for w in caught)


def test_progress_line_has_an_eta_and_is_silent_by_default(capsys):
    quiet = progress_module.Progress("scoring", 4, "blocks", delay=0)
    quiet.update(2)
    quiet.close()
    assert capsys.readouterr().err == ""
    shown = progress_module.Progress(
        "scoring", 4, "blocks", enabled=True, delay=0
    )
    shown.update(2)
    shown.close()
    err = capsys.readouterr().err
    assert "scoring: 2/4 blocks (50%)" in err and "ETA" in err
    assert "done in" in err
    previous = progress_module.show_progress()
    try:
        assert progress_module.Progress("x", 1, "u").enabled
    finally:
        progress_module.show_progress(previous)


def test_evaluation_and_calibration_report_progress(
    tmp_path, tmp_path_factory, monkeypatch, capsys
):
    from keras_mhf import evaluation
    from keras_mhf.evaluation import calibration
    from keras_mhf.evaluation import scoring
    from keras_mhf.models import MultiHashFormerCausalLM

    tokenizer = _tokenizer(
        str(tmp_path_factory.getbasetemp() / "first_run.model")
    )
    lm = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b64", sequence_length=16
    )
    immediate = functools.partial(progress_module.Progress, delay=0)
    monkeypatch.setattr(scoring, "Progress", immediate)
    monkeypatch.setattr(evaluation.tasks, "Progress", immediate)
    monkeypatch.setattr(calibration, "Progress", immediate)
    path = tmp_path / "last_word.jsonl"
    evaluation.write_last_word_file(
        [" ".join(CORPUS[i : i + 3]) for i in range(10)], str(path), count=5
    )
    metrics, _ = evaluation.lambada(
        lm, tokenizer, str(path), batch_size=2, progress=True
    )
    blocks = np.ones((3, 17), "int32")
    evaluation.perplexity(lm, blocks, batch_size=2, progress=True)
    calibration.raw_scores(lm, blocks, batch_size=2, progress=True)
    err = capsys.readouterr().err
    examples = metrics["examples"]
    assert f"lambada {path}: {examples}/{examples} passages" in err
    assert "perplexity: 3/3 blocks" in err
    assert "calibration: 3/3 blocks" in err
    # Without progress=True (and no show_progress()), nothing is printed.
    evaluation.perplexity(lm, blocks, batch_size=2)
    assert capsys.readouterr().err == ""


NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR",
    "I0000 00:00:1796158523.177610   28444 port.cc:153] oneDNN custom "
    "operations are on. You may see slightly different numerical results.",
    "I0000 00:00:1796158523.178759   28444 cudart_stub.cc:31] Could not find "
    "cuda drivers on your machine, GPU will not be used.",
]
CUINIT = (
    "E0000 00:00:1796158528.299595   28444 cuda_platform.cc:52] failed call "
    "to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR "
    "(303)"
)


def test_only_start_up_noise_is_dropped():
    for line in NOISE:
        assert native_logs.is_noise(line, nvidia_driver=True)
    assert native_logs.is_noise(CUINIT, nvidia_driver=False)
    # With an NVIDIA driver, a failed cuInit is a real error.
    assert not native_logs.is_noise(CUINIT, nvidia_driver=True)
    for real in (
        "E0000 00:00:1.0 1 op_kernel.cc:1] INVALID_ARGUMENT: bad input",
        "W0000 00:00:1.0 1 some.cc:1] a warning",
        "Traceback (most recent call last):",
    ):
        assert not native_logs.is_noise(real, nvidia_driver=False)


def test_the_filter_keeps_real_lines_in_order(monkeypatch, capfd):
    monkeypatch.setenv(native_logs.ENVIRONMENT_VARIABLE, "1")
    monkeypatch.setattr(native_logs, "has_nvidia_driver", lambda: False)
    with native_logs.filtered_startup():
        for line in [NOISE[0], "first real line", CUINIT, NOISE[1], "second"]:
            os.write(2, (line + "\n").encode())
    assert capfd.readouterr().err == "first real line\nsecond\n"
    # Off unless asked for: everything passes.
    monkeypatch.setenv(native_logs.ENVIRONMENT_VARIABLE, "0")
    with native_logs.filtered_startup():
        os.write(2, (NOISE[0] + "\n").encode())
    assert capfd.readouterr().err == NOISE[0] + "\n"


def test_an_entry_point_starts_without_tensorflow_noise():
    env = dict(os.environ, KERAS_MHF_QUIET_STARTUP="1")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    code = (
        "import keras_mhf, sys, tensorflow as tf; tf.constant(1) + 1; "
        "print('real line', file=sys.stderr)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "real line" in lines
    nvidia = native_logs.has_nvidia_driver()
    assert [line for line in lines if native_logs.is_noise(line, nvidia)] == []
