"""Training faults: a run SIGKILLed at every point of a checkpoint write,
damaged checkpoints, checkpoints of other settings, and a diverging loss.
Every resumed run must end with the uninterrupted run's weights, to the
bit; nothing non-finite or partial may ever be loaded or written."""

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

from keras_mhf.pretraining import CheckpointError
from keras_mhf.pretraining import NonFiniteTrainingError
from keras_mhf.pretraining import NonFiniteWeightsError
from keras_mhf.pretraining import RunConfigError
from keras_mhf.pretraining import pretrain
from keras_mhf.pretraining import training
from keras_mhf.pretraining.checkpoint_store import TEMPORARY_MARK
from tests.conftest import REPO
from tests.pretraining_helpers import RUN
from tests.pretraining_helpers import assert_same_state
from tests.pretraining_helpers import checkpoint_variables
from tests.pretraining_helpers import compilation_cache
from tests.pretraining_helpers import compilation_cache_env
from tests.pretraining_helpers import prepared_corpus
from tests.pretraining_helpers import reference_run
from tests.pretraining_helpers import state_of

# `RUN`'s 4 validation windows are too few to calibrate on: its finished MHF
# runs skip calibration with this warning (tested on its own).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The scoring temperature was not calibrated:UserWarning"
)


@pytest.fixture(scope="module", autouse=True)
def _compile_once(tmp_path_factory):
    with compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.fixture
def env(tmp_path_factory):
    """A subprocess environment that shares the compilation cache."""
    return compilation_cache_env(
        str(tmp_path_factory.getbasetemp() / "jax_cache")
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepared_corpus(str(tmp_path_factory.getbasetemp() / "corpus"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(str(tmp_path_factory.getbasetemp()))


def checkpoints(output):
    root = os.path.join(output, "checkpoints")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def copy_run(reference, destination, keep_steps):
    """A copy of the reference run's output as it stood after `keep_steps`
    (its checkpoint directories among them)."""
    _, source = reference
    os.makedirs(os.path.join(destination, "checkpoints"))
    for step in keep_steps:
        name = f"step_{step:06d}"
        shutil.copytree(
            os.path.join(source, "checkpoints", name),
            os.path.join(destination, "checkpoints", name),
        )
    return str(destination)


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


KILLED_CHILD = """
import os, signal, sys
from keras_mhf import pretraining
from keras_mhf.pretraining import hooks

event, step = sys.argv[3], "step_%06d" % int(sys.argv[4])

def kill(name, path=None, **info):
    if name == event and step in str(path):
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind

hooks.event = kill
pretraining.pretrain(sys.argv[1], sys.argv[2], **{run})
raise SystemExit("the run was not killed")
"""

# Where a run is killed: while Orbax writes step 2 in the background (the
# main thread has gone on), once step 3's directory is complete but before
# its rename (in Orbax's thread), and after step 3's commit.
KILLS = (
    ("checkpoint_started", 2, ["step_000001"]),
    ("checkpoint_complete", 3, ["step_000001", "step_000002"]),
    ("checkpoint_committed", 3, ["step_000002", "step_000003"]),
)


def test_a_run_killed_at_every_point_of_a_checkpoint_write_resumes_exactly(
    tmp_path, corpus, reference, env
):
    """One run, SIGKILLed again and again, each time at another point of a
    checkpoint write, and resumed each time. It must end with the
    uninterrupted run's weights and optimizer state."""
    output = str(tmp_path / "run")
    script = textwrap.dedent(KILLED_CHILD).replace("{run}", repr(RUN))
    for event, step, complete in KILLS:
        done = subprocess.run(
            [sys.executable, "-c", script, corpus[0], output, event, str(step)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=str(REPO),
            env=env,
        )
        # Only the hook kills the child (it exits 1 if the run ends unkilled).
        assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
        names = checkpoints(output)
        # What the kill left half-written is only ever a temporary directory.
        assert [n for n in names if TEMPORARY_MARK not in n] == complete, names
    lm, summary = pretrain(corpus[0], output, **RUN)
    assert summary["finished"]
    assert_same_state(state_of(lm), reference[0])
    assert checkpoints(output) == ["step_000003", "step_000004"]
    log = open(os.path.join(output, "log.csv")).read().splitlines()
    assert [row.split(",")[0] for row in log[1:]] == ["1", "2", "3", "4"]


def flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def largest_file(directory):
    """The largest file of a checkpoint: one holding variables' values."""
    files = [
        os.path.join(root, name)
        for root, _, names in os.walk(directory)
        for name in names
    ]
    return max(files, key=os.path.getsize)


def test_damaged_newer_checkpoints_fall_back_to_the_last_good_one(
    tmp_path, corpus, reference
):
    output = copy_run(reference, tmp_path / "run", keep_steps=(2, 3, 4))
    step_3, step_4 = (
        os.path.join(output, "checkpoints", f"step_00000{s}") for s in (3, 4)
    )
    truncate(largest_file(step_4))
    flip_a_byte(largest_file(step_3))  # same size
    with pytest.warns(UserWarning) as warned:
        lm, summary = pretrain(corpus[0], output, **RUN)
    messages = [str(w.message) for w in warned]
    assert any(
        re.search(re.escape(step_4) + r" \(step 4\) is unusable.*bytes", m)
        for m in messages
    )
    assert any(
        re.search(re.escape(step_3) + r" \(step 3\) is unusable.*sha256", m)
        for m in messages
    )
    assert summary["finished"]
    assert_same_state(state_of(lm), reference[0])
    names = checkpoints(output)
    assert "step_000003.unusable" in names and "step_000004.unusable" in names


def test_no_usable_checkpoint_is_a_clear_error_not_a_fresh_start(
    tmp_path, corpus, reference
):
    output = copy_run(reference, tmp_path / "run", keep_steps=(3, 4))
    truncate(largest_file(os.path.join(output, "checkpoints", "step_000004")))
    os.remove(os.path.join(output, "checkpoints", "step_000003", "state.json"))
    # Refused, and refused again by the same command: nothing is moved, so
    # a rerun never silently starts from scratch.
    for _ in range(2):
        with pytest.raises(
            CheckpointError, match="none can be loaded"
        ) as error:
            pretrain(corpus[0], output, **RUN)
        assert "Nothing was loaded or moved" in str(error.value)
        assert "--discard-unusable-checkpoints" in str(error.value)
        assert checkpoints(output) == ["step_000003", "step_000004"]
    with open(os.path.join(output, "summary.json")) as f:
        summary = json.load(f)
    assert summary["status"] == "failed"
    assert summary["error"] == "CheckpointError"
    assert not os.path.exists(os.path.join(output, "preset"))
    # Said explicitly: set aside, and a run from step 0.
    with pytest.warns(UserWarning, match=r"\(step 4\) is unusable.*step 0"):
        lm, summary = pretrain(
            corpus[0], output, **RUN, discard_unusable_checkpoints=True
        )
    assert summary["finished"]
    assert_same_state(state_of(lm), reference[0])
    names = checkpoints(output)
    assert "step_000003.unusable" in names and "step_000004.unusable" in names


def edit_state(checkpoint, **fields):
    path = os.path.join(checkpoint, "state.json")
    with open(path) as f:
        state = json.load(f)
    state.update(fields)
    with open(path, "w") as f:
        json.dump(state, f)
    return state


def test_an_edited_state_json_makes_its_checkpoint_unusable(
    tmp_path, corpus, reference
):
    """`state.json` is checked like the checkpoint's other files: an
    edited step (which once resumed at the wrong step and ended in Orbax's
    `StepAlreadyExistsError`) sets the checkpoint aside, naming the file,
    and the previous one is used; a checkpoint of format version 2 (no
    sha256 of the state's fields) is still resumed."""
    output = copy_run(reference, tmp_path / "run", keep_steps=(2, 3, 4))
    step_3, step_4 = (
        os.path.join(output, "checkpoints", f"step_00000{s}") for s in (3, 4)
    )
    kept = os.path.join(tmp_path, "only_step_4")
    os.makedirs(os.path.join(kept, "checkpoints"))
    shutil.copytree(step_4, os.path.join(kept, "checkpoints", "step_000004"))
    state = edit_state(step_3, format_version=2)
    del state["state_sha256"]
    with open(os.path.join(step_3, "state.json"), "w") as f:
        json.dump(state, f)
    edit_state(step_4, step=3)
    with pytest.warns(UserWarning) as warned:
        lm, summary = pretrain(corpus[0], output, **RUN)
    assert any(
        re.search(
            re.escape(step_4)
            + r" \(step 4\) is unusable \("
            + re.escape(os.path.join(step_4, "state.json"))
            + r" does not match the sha256",
            str(w.message),
        )
        for w in warned
    ), [str(w.message) for w in warned]
    assert summary["finished"]
    assert_same_state(state_of(lm), reference[0])
    names = checkpoints(output)
    assert "step_000004.unusable" in names and "step_000004" in names
    # The edit made with the sha256 too: the step is not the folder's.
    state = edit_state(os.path.join(kept, "checkpoints", "step_000004"), step=3)
    from keras_mhf.pretraining.checkpoint_store import state_digest

    edit_state(
        os.path.join(kept, "checkpoints", "step_000004"),
        state_sha256=state_digest(state),
    )
    with pytest.raises(
        CheckpointError, match=r"none can be loaded.*state.json records step 3"
    ):
        pretrain(corpus[0], kept, **RUN)
    assert checkpoints(kept) == ["step_000004"]


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(batch_size=8), "batch_size"),
        (dict(steps=6), "steps"),
        (dict(sequence_length=8), "sequence_length"),
        (dict(seed=1), "seed"),
        (dict(architecture="tiny_h4b64"), "architecture"),
    ],
)
def test_a_checkpoint_of_other_settings_is_refused(
    tmp_path, corpus, reference, change, named
):
    output = copy_run(reference, tmp_path / "run", keep_steps=(2,))
    with pytest.raises(RunConfigError, match=f"different settings.*{named}"):
        pretrain(corpus[0], output, **dict(RUN, **change))
    assert checkpoints(output) == ["step_000002"]


def test_a_checkpoint_of_other_data_is_refused(tmp_path, corpus, reference):
    from keras_mhf.data import prepare_data
    from tests.pretraining_helpers import write_documents

    other = str(tmp_path / "other")
    prepare_data(
        write_documents(tmp_path / "docs.jsonl", count=150, seed=7),
        corpus[1],
        other,
        validation_fraction=0.2,
        workers=1,
        progress=False,
    )
    output = copy_run(reference, tmp_path / "run", keep_steps=(2,))
    with pytest.raises(RunConfigError, match="different settings.*data"):
        pretrain(other, output, **RUN)


def finite_everywhere(checkpoint):
    return all(
        np.isfinite(v).all()
        for v in checkpoint_variables(checkpoint).values()
        if v.dtype.kind == "f"
    )


def test_a_diverging_run_stops_keeps_its_last_finite_checkpoint_and_fails(
    tmp_path, corpus, env
):
    output = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_mhf.cli.main",
            "pretrain",
            "--data",
            corpus[0],
            "--output",
            str(output),
            "--architecture",
            "tiny_h3b64",
            "--sequence-length",
            "16",
            "--batch-size",
            "4",
            "--steps",
            "6",
            "--checkpoint-every",
            "1",
            "--warmup-steps",
            "1",
            "--validation-blocks",
            "4",
            "--learning-rate",
            "1e6",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    # The training loss, the validation loss or (on some backends) first
    # the weights turn non-finite; a checkpoint needs all of them finite.
    match = re.search(
        r"error: (NonFiniteLossError: the (training|validation) "
        r"loss|NonFiniteWeightsError: the weights) became non-finite "
        r".*?(at|by) step (\d+)[ ;].*(The last good checkpoint \(step "
        r"(\d+): finite weights, optimizer state and validation loss\) is "
        r"kept in (\S+)\.|No checkpoint had been written yet\.) Rerun with a "
        r"lower --learning-rate \(it was 1e\+06\)",
        done.stderr,
    )
    assert match, done.stderr[-2000:]
    bad_step = int(match[4])
    kept_step = int(match[6]) if match[6] else 0
    assert kept_step == bad_step - 1 and bad_step < 6
    if kept_step:
        assert match[7] == str(output / "checkpoints" / f"step_{kept_step:06d}")
        assert checkpoints(str(output))[-1] == f"step_{kept_step:06d}"
    for name in checkpoints(str(output)):
        assert finite_everywhere(output / "checkpoints" / name)
        with open(output / "checkpoints" / name / "state.json") as f:
            assert np.isfinite(json.load(f)["validation_loss"])
    assert not any(p.name.startswith("preset") for p in output.iterdir())
    with open(output / "summary.json") as f:
        summary = json.load(f)
    assert summary["status"] == "failed"
    assert summary["last_good_step"] == (kept_step or None)


def test_a_resumed_run_never_replaces_a_good_checkpoint_with_a_bad_one(
    tmp_path, corpus, reference
):
    output = copy_run(reference, tmp_path / "run", keep_steps=(1, 2))
    # One chunk for steps 3-4 (checkpoint_every may change on resume), so
    # however the divergence shows, no checkpoint is due before it.
    settings = dict(RUN, learning_rate=1e6, checkpoint_every=2)

    def contents():
        found = {}
        for name in checkpoints(output):
            for root, _, files in os.walk(
                os.path.join(output, "checkpoints", name)
            ):
                for file in files:
                    with open(os.path.join(root, file), "rb") as f:
                        found[root, file] = f.read()
        return found

    before = contents()
    with pytest.warns(UserWarning, match="other optimizer settings"):
        # The loss, or first the weights, become non-finite.
        with pytest.raises(NonFiniteTrainingError) as error:
            pretrain(corpus[0], output, **settings)
    assert error.value.step in (3, 4)
    assert error.value.checkpoint.endswith("step_000002")
    assert contents() == before
    with open(os.path.join(output, "summary.json")) as f:
        summary = json.load(f)
    assert summary["status"] == "failed" and summary["last_good_step"] == 2


@pytest.mark.parametrize(
    "target, error_class, named",
    [
        # A weight: the validation loss (or the weights) turns non-finite.
        ("weight", NonFiniteTrainingError, "step 2"),
        # An AdamW slot, which no loss sees: the check that runs while the
        # checkpoint is written stops its commit.
        ("optimizer slot", NonFiniteWeightsError, "by step 2"),
    ],
)
def test_non_finite_weights_are_never_checkpointed(
    tmp_path, corpus, monkeypatch, target, error_class, named
):
    real_train_chunk = training.train_chunk
    poisoned = []

    def poisoning_train_chunk(config, lm, data, first, last, *rest):
        history = real_train_chunk(config, lm, data, first, last, *rest)
        if last == 2:  # a value turns NaN while the loss stays finite
            if target == "weight":
                variable = lm.backbone.trainable_weights[0]
            else:
                variable = [
                    v for v in lm.optimizer.variables if len(v.shape) == 2
                ][0]
            value = np.array(keras.ops.convert_to_numpy(variable.value))
            value.flat[0] = np.nan
            variable.assign(value)
            poisoned.append(variable.path)
        return history

    monkeypatch.setattr(training, "train_chunk", poisoning_train_chunk)
    output = str(tmp_path / "run")
    with pytest.raises(error_class, match=named) as error:
        pretrain(corpus[0], output, **RUN)
    assert len(poisoned) == 1  # the run trained through the patched chunk
    assert error.value.checkpoint.endswith("step_000001")
    # Nothing of step 2 is left, not even a temporary directory.
    assert checkpoints(output) == ["step_000001"]
    assert "Rerun with a lower --learning-rate" in str(error.value)


def test_a_run_of_0_1_resumes_from_its_h5_checkpoint(
    tmp_path, corpus, reference
):
    """keras_mhf 0.1 wrote `model.weights.h5` checkpoints (format version 1,
    `mixed_precision` among the settings): a run resumes from one after
    its sha256 check and ends with the uninterrupted run's weights; a
    damaged one is set aside like any other."""
    from keras_mhf.pretraining import WEIGHTS_FILE
    from keras_mhf.pretraining import RunCheckpoints
    from keras_mhf.pretraining import RunConfig
    from keras_mhf.pretraining import load_data
    from keras_mhf.utils.files import file_sha256

    output = copy_run(reference, tmp_path / "run", keep_steps=(2,))
    step_2 = os.path.join(output, "checkpoints", "step_000002")
    with open(os.path.join(step_2, "state.json")) as f:
        state = json.load(f)
    config = RunConfig(corpus[0], output, **RUN)
    data = load_data(config)
    lm = training.build_run_model(config, data.tokenizer)
    assert RunCheckpoints.of(config).resume(lm, data) == 2
    shutil.rmtree(step_2)
    os.makedirs(step_2)
    weights = os.path.join(step_2, WEIGHTS_FILE)
    lm.save_weights(weights)
    settings = dict(state["settings"], mixed_precision=False)
    del settings["precision"]
    del state["files"]
    state.update(
        format_version=1,
        settings=settings,
        weights=dict(
            file=WEIGHTS_FILE,
            bytes=os.path.getsize(weights),
            sha256=file_sha256(weights),
        ),
    )
    with open(os.path.join(step_2, "state.json"), "w") as f:
        json.dump(state, f)
    kept = os.path.join(tmp_path, "h5_copy")
    shutil.copytree(output, kept)
    lm, summary = pretrain(corpus[0], output, **RUN)
    assert summary["finished"]
    assert_same_state(state_of(lm), reference[0])
    assert checkpoints(output) == ["step_000003", "step_000004"]
    flip_a_byte(os.path.join(kept, "checkpoints", "step_000002", WEIGHTS_FILE))
    with pytest.raises(CheckpointError, match=r"none can be loaded.*sha256"):
        pretrain(corpus[0], kept, **RUN)
