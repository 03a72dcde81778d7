"""`RunCheckpoints`, one run's checkpoints: one object per run, the step
folders' names read and written in one place, the temporary folders a
failed write left removed, and messages that name the last committed
checkpoint without reading, checking or moving any."""

import os

from keras_mhf.pretraining import NonFiniteLossError
from keras_mhf.pretraining import RunCheckpoints
from keras_mhf.pretraining import RunConfig
from keras_mhf.pretraining import checkpoints as checkpoints_module


def test_one_object_per_run_names_lists_and_cleans_its_checkpoints(
    tmp_path,
):
    config = RunConfig(data="unused", output_dir=str(tmp_path / "run"))
    checkpoints = RunCheckpoints.of(config)
    assert RunCheckpoints.of(config) is checkpoints
    other = RunConfig(data="unused", output_dir=str(tmp_path / "run"))
    assert RunCheckpoints.of(other) is not checkpoints
    assert not hasattr(checkpoints_module, "_WRITERS")
    root = str(tmp_path / "run" / "checkpoints")
    assert checkpoints.root == root
    assert checkpoints.directory(7) == os.path.join(root, "step_000007")
    assert checkpoints.committed() == []
    for name in (
        "step_000002",
        "step_000010",  # no state.json: unusable, but committed by name
        "step_000003.unusable",
        "step_000004.orbax-checkpoint-tmp-1234",
        ".tmp-5",
        "notes",
    ):
        os.makedirs(os.path.join(root, name))
    expected = [
        (10, os.path.join(root, "step_000010")),
        (2, os.path.join(root, "step_000002")),
    ]
    assert checkpoints.committed() == expected
    checkpoints.remove_stale()
    assert sorted(os.listdir(root)) == [
        "notes",
        "step_000002",
        "step_000003.unusable",
        "step_000010",
    ]
    # A message names the newest folder and changes nothing.
    error = checkpoints.non_finite_stop(NonFiniteLossError, "It broke.", 11)
    assert error.checkpoint == os.path.join(root, "step_000010")
    assert "The last good checkpoint (step 10" in str(error)
    assert "Rerun with a lower --learning-rate" in str(error)
    assert "step 10 (" in checkpoints.resume_advice()
    assert sorted(os.listdir(root)) == [
        "notes",
        "step_000002",
        "step_000003.unusable",
        "step_000010",
    ]
