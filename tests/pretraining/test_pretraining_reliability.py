"""Nothing silent, part 2 (issue #21, items 1-4): one run per output (a lock
that dies with its process, settings recorded in run.json), prepared shards
verified before they are trusted, a full disk said in one line with nothing
partial left, checkpoints kept only when their validation loss is finite,
and summary.json on every exit. Fault tests: JAX only (the run's file
handling does not depend on the backend)."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from keras_mhf.data import PreparedCorpus
from keras_mhf.data import prepare_data
from keras_mhf.pretraining import DiskFullError
from keras_mhf.pretraining import NonFiniteLossError
from keras_mhf.pretraining import OutputLockedError
from keras_mhf.pretraining import RunConfigError
from keras_mhf.pretraining import hooks
from keras_mhf.pretraining import pretrain
from keras_mhf.utils import disk_space
from keras_mhf.utils.output_lock import LOCK_FILE
from keras_mhf.utils.output_lock import output_lock
from tests.conftest import REPO
from tests.pretraining_helpers import RUN
from tests.pretraining_helpers import compilation_cache_env
from tests.pretraining_helpers import compile_once_fixture  # noqa: F401
from tests.pretraining_helpers import corpus_fixture  # noqa: F401
from tests.pretraining_helpers import run_flags
from tests.pretraining_helpers import stop_after_chunks

pytestmark = [
    pytest.mark.skipif(
        keras.config.backend() != "jax",
        reason="fault tests of the run's files run under JAX only",
    ),
    pytest.mark.filterwarnings(
        "ignore:The scoring temperature was not calibrated:UserWarning"
    ),
]


def read_summary(output):
    with open(os.path.join(output, "summary.json")) as f:
        return json.load(f)


def copy_corpus(corpus, destination):
    shutil.copytree(corpus[0], destination)
    return str(destination)


# Item 1: one run per output.

LOCK_HOLDER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("output_lock", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)  # stdlib only: no Keras import
with module.output_lock(sys.argv[2], "a test holder"):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_a_second_run_on_a_locked_output_is_refused_naming_the_first(
    tmp_path, corpus
):
    output = str(tmp_path / "run")
    with output_lock(output, "the first run") as holder:
        with pytest.raises(OutputLockedError, match="being written by") as e:
            pretrain(corpus[0], output, **RUN)
        assert f"process {holder['pid']}" in str(e.value)
        assert "the first run" in str(e.value)
        # The refused run wrote nothing: no run record, no summary.
        assert sorted(os.listdir(output)) == [LOCK_FILE]
        with pytest.raises(OutputLockedError):
            prepare_data(
                os.path.join(os.path.dirname(corpus[0]), "docs.jsonl"),
                corpus[1],
                output,
                workers=1,
                progress=False,
            )
    assert not os.path.exists(output)  # the lock's directory, removed


def test_the_lock_dies_with_a_killed_process(tmp_path):
    directory = str(tmp_path / "out")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LOCK_HOLDER,
            str(REPO / "keras_mhf" / "utils" / "output_lock.py"),
            directory,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(OutputLockedError, match="a test holder"):
            with output_lock(directory, "second"):
                pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert os.path.exists(os.path.join(directory, LOCK_FILE))  # stale
    with output_lock(directory, "after the kill") as record:
        assert record["pid"] == os.getpid()
    assert not os.path.exists(os.path.join(directory, LOCK_FILE))


def test_a_different_command_on_the_same_output_is_refused(tmp_path, corpus):
    output = str(tmp_path / "run")
    # Stopped before its first chunk: no checkpoint exists yet.
    with stop_after_chunks(0):
        _, summary = pretrain(corpus[0], output, **RUN)
        assert summary["status"] == "incomplete"
        assert read_summary(output)["status"] == "incomplete"
        with open(os.path.join(output, "run.json")) as f:
            assert json.load(f)["settings"]["seed"] == 0
        with pytest.raises(RunConfigError, match=r"other settings \(seed: 0"):
            pretrain(corpus[0], output, **dict(RUN, seed=1))
        # The same command is welcome (it resumes).
        pretrain(corpus[0], output, **RUN)


# Item 2: shards are verified before they are trusted.


def test_a_corrupted_shard_is_named_before_training(tmp_path, corpus):
    damaged = copy_corpus(corpus, tmp_path / "prepared")
    shard = PreparedCorpus(damaged).shard_paths("train")[0]
    ids = np.fromfile(shard, "<u2")
    ids[10:60] ^= 1  # the low bit: still valid token ids
    ids.tofile(shard)
    output = str(tmp_path / "run")
    with pytest.raises(RunConfigError) as error:
        pretrain(damaged, output, **RUN)
    assert shard in str(error.value) and "sha256" in str(error.value)
    assert "keras-mhf prepare" in str(error.value)
    assert "--no-verify" in str(error.value)
    assert not os.path.exists(output)  # refused before training: no trace
    # --no-verify trusts it (the user asked for it).
    with stop_after_chunks(0):
        pretrain(damaged, output, verify_data=False, **RUN)


def test_out_of_vocabulary_ids_name_the_shard_and_offset(tmp_path, corpus):
    damaged = copy_corpus(corpus, tmp_path / "prepared")
    prepared = PreparedCorpus(damaged)
    shard = prepared.shard_paths("train")[1]
    ids = np.fromfile(shard, "<u2")
    ids[7] = prepared.vocabulary_size + 3
    ids.tofile(shard)
    with pytest.raises(ValueError, match=r"token id \d+ at token offset 7 "):
        PreparedCorpus(damaged).verify_checksums()
    # Unverified, the loader names it when a window reaches it.
    start = int(PreparedCorpus(damaged)._offsets["train"][1])
    with pytest.raises(ValueError, match=f"{shard} holds .* offset 7 "):
        PreparedCorpus(damaged).windows("train", np.array([start]), 16)
    with pytest.raises(ValueError, match="offset 7 "):
        PreparedCorpus(damaged).read("train", start - 3, 16)


def test_verification_reports_what_it_read(corpus):
    report = PreparedCorpus(corpus[0]).verify_checksums()
    sizes = [
        os.path.getsize(p)
        for split in ("train", "validation")
        for p in PreparedCorpus(corpus[0]).shard_paths(split)
    ]
    assert report["shards"] == len(sizes) and report["bytes"] == sum(sizes)
    assert report["seconds"] >= 0


# Item 3: a full disk.


def test_a_full_disk_is_refused_before_a_checkpoint_write(
    tmp_path, corpus, monkeypatch
):
    output = str(tmp_path / "run")
    real = shutil.disk_usage

    def nearly_full(path):
        usage = real(path)
        full = "checkpoints" in str(path) and os.path.isdir(
            os.path.join(output, "checkpoints", "step_000002")
        )
        return usage._replace(free=1000) if full else usage

    monkeypatch.setattr(disk_space.shutil, "disk_usage", nearly_full)
    with pytest.raises(DiskFullError) as error:
        pretrain(corpus[0], output, **RUN)
    message = str(error.value)
    assert "\n" not in message
    assert "checkpoint step_000003" in message
    assert "The last complete checkpoint is step 2" in message
    assert (
        "free space (or raise the file-size limit) and rerun the same"
        in message
    )
    names = os.listdir(os.path.join(output, "checkpoints"))
    assert sorted(names) == ["step_000001", "step_000002"]
    summary = read_summary(output)
    assert summary["status"] == "failed" and summary["last_good_step"] == 2


def test_a_failed_preset_write_leaves_no_temporary_directory(
    tmp_path, corpus, monkeypatch
):
    from keras_mhf.models import MultiHashFormerCausalLM

    def full_disk(self, directory):
        os.makedirs(directory)
        with open(os.path.join(directory, "config.json"), "w") as f:
            f.write("{")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MultiHashFormerCausalLM, "save_to_preset", full_disk)
    output = str(tmp_path / "run")
    with pytest.raises(DiskFullError, match="while writing the preset"):
        pretrain(corpus[0], output, **dict(RUN, steps=1))
    assert not any(name.startswith("preset") for name in os.listdir(output))
    assert read_summary(output)["last_good_step"] == 1


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """`summary.json` (and every file `write_json` writes) is replaced
    through a temporary file; a write that fails for lack of space keeps the
    old file and removes the temporary one (a `summary.json.tmp-PID` stayed
    in the output after a full disk stopped the preset write)."""
    from keras_mhf.utils import files

    path = tmp_path / "summary.json"
    files.write_json(str(path), {"status": "running"})

    def full_disk(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        files.write_json(str(path), {"status": "failed"})
    assert os.listdir(tmp_path) == ["summary.json"]
    assert json.loads(path.read_text()) == {"status": "running"}


def test_an_unreadable_log_line_on_resume_names_the_file_and_line(tmp_path):
    """A resumed run cuts `log.csv` back to its step; a row whose step is no
    number was `ValueError: invalid literal for int()` without the file."""
    from types import SimpleNamespace

    from keras_mhf.pretraining.logs import LOG_FIELDS
    from keras_mhf.pretraining.logs import trim_log

    log = tmp_path / "log.csv"
    rows = ["1,64", "2,128", "x3,192", "4,256"]
    log.write_text(",".join(LOG_FIELDS) + "\n" + "\n".join(rows) + "\n")
    config = SimpleNamespace(path=lambda name: str(tmp_path / name))
    before = log.read_text()
    with pytest.raises(
        RunConfigError,
        match=rf"{re.escape(str(log))}:4: not a log\.csv row \(its step is "
        r"'x3'\).*Delete or fix that line \(or delete log\.csv",
    ):
        trim_log(config, 2)
    assert log.read_text() == before
    log.write_text(before.replace("x3", "3"))
    trim_log(config, 2)
    kept = [line.split(",")[:2] for line in log.read_text().splitlines()[1:]]
    assert kept == [["1", "64"], ["2", "128"]]


DISK_FULL_CHILD = """
import sys
from keras_mhf.cli.main import main
from keras_mhf.pretraining import checkpoints
# A disk that fills up between the free-space check and the write.
checkpoints.check_free_space = lambda *args, **kwargs: None
sys.exit(main(["pretrain"] + sys.argv[1:]))
"""


def test_a_disk_that_fills_during_a_checkpoint_write_exits_cleanly(
    tmp_path, corpus, tmp_path_factory
):
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
    )
    if made.returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        output = mount / "run"
        script = DISK_FULL_CHILD
        settings = dict(RUN, architecture="tiny_h4b1024", steps=2)
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)]
            + ["--data", corpus[0], "--output", str(output)]
            + ["--compilation-cache", "none"]
            + run_flags(settings),
            capture_output=True,
            text=True,
            timeout=600,
            env=compilation_cache_env(
                str(tmp_path_factory.getbasetemp() / "jax_cache")
            ),
        )
        assert done.returncode == 1, done.stderr[-3000:]  # not 139
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(
            "keras-mhf pretrain: error: DiskFullError: no space left on device "
            "while writing checkpoint step_000001 in "
        ), last
        assert "free space (or raise the file-size limit) and rerun" in last
        assert "Traceback" not in done.stderr
        assert "Event loop is closed" not in done.stderr
        leftovers = [
            name
            for _, dirs, files in os.walk(output)
            for name in dirs + files
            if ".tmp-" in name
        ]
        assert leftovers == []
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# Item 4: usable last checkpoints, summary.json on every exit.


def test_a_non_finite_validation_loss_writes_no_checkpoint(
    tmp_path, corpus, monkeypatch
):
    from keras_mhf.pretraining import run as run_module

    real = run_module.write_log_row

    def nan_at_step_2(config, lm, data, history, step, started):
        row = real(config, lm, data, history, step, started)
        if step == 2:
            row["val_loss"] = float("nan")
        return row

    monkeypatch.setattr(run_module, "write_log_row", nan_at_step_2)
    output = str(tmp_path / "run")
    with pytest.raises(NonFiniteLossError) as error:
        pretrain(corpus[0], output, **RUN)
    message = str(error.value)
    assert "validation loss became non-finite (nan) at step 2" in message
    assert "The last good checkpoint (step 1" in message
    assert "Rerun with a lower --learning-rate" in message
    assert error.value.step == 2 and error.value.checkpoint.endswith("1")
    assert os.listdir(os.path.join(output, "checkpoints")) == ["step_000001"]
    summary = read_summary(output)
    assert summary["status"] == "failed"
    assert summary["error"] == "NonFiniteLossError"
    assert summary["last_good_step"] == 1
    assert summary["checkpoint"].endswith("step_000001")
    with open(summary["checkpoint"] + "/state.json") as f:
        assert np.isfinite(json.load(f)["validation_loss"])


def test_an_interrupted_run_says_so_in_its_summary(
    tmp_path, corpus, monkeypatch
):
    def interrupt(name, step=None, **info):
        if name == "train_step" and step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(hooks, "event", interrupt)
    output = str(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        pretrain(corpus[0], output, **RUN)
    summary = read_summary(output)
    assert summary["status"] == "interrupted"
    assert summary["last_good_step"] == 1
    monkeypatch.undo()
    _, finished = pretrain(corpus[0], output, **RUN)
    assert finished["status"] == "finished"
    assert read_summary(output)["status"] == "finished"


def test_a_file_size_limit_during_a_background_write_is_one_clear_line(
    tmp_path, corpus, tmp_path_factory
):
    """`ulimit -f`: Orbax's write in the background fails with TensorStore's
    `OUT_OF_RANGE ... File too large`; the command ends with one line that
    says so, without Orbax's error logs, and leaves no temporary folder."""
    output = tmp_path / "run"
    settings = dict(RUN, architecture="tiny_h4b1024", steps=2)
    command = " ".join(
        [sys.executable, "-m", "keras_mhf.cli.main", "pretrain"]
        + ["--data", corpus[0], "--output", str(output)]
        + ["--compilation-cache", "none"]
        + run_flags(settings)
    )
    done = subprocess.run(
        ["bash", "-c", f"ulimit -f 300; exec {command}"],
        capture_output=True,
        text=True,
        timeout=600,
        env=compilation_cache_env(
            str(tmp_path_factory.getbasetemp() / "jax_cache")
        ),
    )
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "keras-mhf pretrain: error: DiskFullError: a file reached the "
        "file-size limit (ulimit -f) while writing checkpoint step_000001"
    ), last
    # No absl log lines (Orbax logs each failed write with its traceback),
    # nor TensorStore's report that the failed write's event loop is closed.
    assert "absl" not in done.stderr
    assert "Traceback" not in done.stderr
    assert "Event loop is closed" not in done.stderr
    assert not re.search(r"^[EWI]\d{4} ", done.stderr, re.MULTILINE)
    leftovers = [
        name
        for _, dirs, files in os.walk(output)
        for name in dirs + files
        if "tmp" in name
    ]
    assert leftovers == []
