"""Ctrl-C (SIGINT) and SIGTERM stop a run at any point, within seconds."""

import json
import os
import signal
import subprocess
import sys
import time

import keras
import pytest

from keras_mhf.pretraining import RunConfig
from keras_mhf.pretraining import RunConfigError
from keras_mhf.pretraining import pretrain
from tests.pretraining_helpers import RUN
from tests.pretraining_helpers import compilation_cache_env
from tests.pretraining_helpers import prepared_corpus
from tests.pretraining_helpers import run_flags


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepared_corpus(str(tmp_path_factory.getbasetemp() / "corpus"))


class SwallowsCtrlC(keras.callbacks.Callback):
    """Code that catches the KeyboardInterrupt of a Ctrl-C (as code under
    `np.array(x)` did while Keras converted a JAX loss for the callbacks)."""

    def __init__(self):
        super().__init__()
        self.swallowed = 0

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1 and not self.swallowed:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs here
            except KeyboardInterrupt:
                self.swallowed += 1


def test_a_swallowed_ctrl_c_still_stops_the_run(tmp_path, corpus):
    swallower = SwallowsCtrlC()
    output = tmp_path / "run"
    # What the run must restore: Python's Ctrl-C handler, or SIG_IGN in a
    # process started in the background by a shell without job control.
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        pretrain(
            corpus[0],
            str(output),
            callbacks=[swallower],
            **dict(RUN, steps=6, checkpoint_every=3),
        )
    assert swallower.swallowed == 1
    summary = json.loads((output / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["last_good_step"] is None  # stopped in the first chunk
    assert signal.getsignal(signal.SIGINT) is before


def test_steps_past_the_optimizer_counter_are_refused():
    with pytest.raises(RunConfigError, match="steps x micro-batches"):
        RunConfig("d", "o", steps=10**20).validate()
    with pytest.raises(RunConfigError, match="at most 2,147,483,647"):
        RunConfig(
            "d", "o", steps=2**30, gradient_accumulation_steps=2
        ).validate()


@pytest.mark.skipif(
    keras.config.backend() != "jax",
    reason="the signal was lost in JAX's array conversion; other backends "
    "run the same handlers (test above)",
)
def test_sigint_and_sigterm_stop_a_command_mid_chunk(tmp_path, corpus):
    """A real `keras-mhf pretrain` with long chunks, signalled mid-chunk
    after its first checkpoint: Ctrl-C exits 130, SIGTERM 143, within
    seconds, each with an "interrupted" summary; the second run resumed
    from the first's checkpoint."""
    settings = dict(RUN, steps=10**6, checkpoint_every=300, verbose=1)
    command = [sys.executable, "-m", "keras_mhf.cli.main", "pretrain"]
    command += ["--data", corpus[0], "--output", str(tmp_path / "run")]
    command += run_flags(settings)
    log = tmp_path / "run" / "log.csv"
    # The second process reads the first's compiled programs.
    env = dict(
        compilation_cache_env(str(tmp_path / "jax_cache")), KERAS_BACKEND="jax"
    )
    for number, status, rows in (
        (signal.SIGINT, 130, 1),
        (signal.SIGTERM, 143, 2),
    ):
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        # The chunk's log row, then its checkpoint (written in the
        # background, renamed into place when complete: on a busy machine
        # well after the row).
        checkpoint = tmp_path / "run" / "checkpoints" / f"step_{300 * rows:06d}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            if (
                log.exists()
                and len(log.read_text().splitlines()) > rows
                and checkpoint.exists()
            ):
                break
            time.sleep(0.2)
        assert process.poll() is None, process.stderr.read()[-2000:]
        time.sleep(0.7)  # into the next chunk's fit
        sent = time.monotonic()
        process.send_signal(number)
        try:
            code = process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"still training 20 s after signal {number}")
        assert code == status, process.stderr.read()[-2000:]
        assert time.monotonic() - sent < 20
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["status"] == "interrupted"
        # Stopped inside the next chunk: no checkpoint after that one.
        assert summary["last_good_step"] == 300 * rows
