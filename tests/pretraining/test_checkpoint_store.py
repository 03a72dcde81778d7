"""The Orbax writer and reader (`checkpoint_store`): small variables packed
per dtype, large ones alone, both read back exactly; a mismatched packing
table is an error; a failure on the writer thread surfaces at `wait`."""

import json
import os

import keras
import numpy as np
import pytest

from keras_mhf.pretraining import checkpoint_store
from keras_mhf.pretraining.checkpoint_store import PACKS
from keras_mhf.pretraining.checkpoint_store import STATE_FILE
from keras_mhf.pretraining.checkpoint_store import TEMPORARY_MARK
from keras_mhf.pretraining.checkpoint_store import CheckpointWriter
from keras_mhf.pretraining.checkpoint_store import VariableLayout
from keras_mhf.pretraining.checkpoint_store import read_variables
from keras_mhf.pretraining.checkpoint_store import restore_variables
from tests.pretraining_helpers import state_of


def build(seed, architecture="tiny_h3b64"):
    """A tiny model with its AdamW state, every variable random (`seed`)."""
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.optimizers import BiasCorrectedAdamW

    keras.utils.set_random_seed(seed)
    lm = MultiHashFormerCausalLM.from_tokens(
        [f"token{i}" for i in range(64)], architecture, pad_token_id=2
    )
    lm.compile(optimizer=BiasCorrectedAdamW(1e-3))
    lm.optimizer.build(lm.trainable_variables)
    rng = np.random.default_rng(seed)
    for v in list(lm.weights) + list(lm.optimizer.variables):
        dtype = keras.backend.standardize_dtype(v.dtype)
        if "float" in dtype:
            v.assign(rng.normal(size=v.shape).astype(dtype))
        else:
            v.assign(rng.integers(0, 50, size=v.shape).astype(dtype))
    return lm


@pytest.fixture(scope="module")
def lm():
    return build(seed=1)


def written(tmp_path, lm, step=3):
    writer = CheckpointWriter(str(tmp_path), keep=1)
    try:
        writer.save(step, lm, {"step": step})
    finally:
        writer.close()
    return writer.directory(step)


@pytest.mark.parametrize("pack_bytes", [2**20, 1000, 0])
def test_packed_and_single_variables_are_read_back_exactly(
    tmp_path, lm, monkeypatch, pack_bytes
):
    # All variables packed (the default), some, and none.
    monkeypatch.setattr(checkpoint_store, "PACK_BYTES", pack_bytes)
    layout = VariableLayout(lm)
    packed = sum(len(pack) for pack in layout.packs)
    assert packed + len(layout.singles) == len(layout.variables)
    assert (packed == len(layout.variables)) == (pack_bytes == 2**20)
    assert (packed == 0) == (pack_bytes == 0)
    tree, _ = layout.snapshot()
    assert (PACKS in tree) == (packed > 0)
    directory = written(tmp_path, lm)

    with open(os.path.join(directory, STATE_FILE)) as f:
        assert json.load(f)["packed"] == layout.packed
    found = read_variables(directory)
    expected = state_of(lm)
    flat = [found[g][k] for g in ("model", "optimizer") for k in found[g]]
    assert len(flat) == len(expected)
    for a, b in zip(flat, expected):
        np.testing.assert_array_equal(a, b)

    other = build(seed=2)
    restore_variables(directory, other)
    for a, b in zip(state_of(other), expected):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_packs_are_read_back_exactly(tmp_path):
    keras.config.set_dtype_policy("bfloat16")  # reset after each test
    lm = build(seed=4)
    layout = VariableLayout(lm)
    assert any(name.startswith("bfloat16_") for name in layout.packed)
    directory = written(tmp_path, lm)
    other = build(seed=5)
    restore_variables(directory, other)
    for a, b in zip(state_of(other), state_of(lm)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_of_another_shape_is_refused(tmp_path, lm):
    directory = written(tmp_path, lm)
    with pytest.raises(ValueError, match=r"variable \d+ has shape \(64, "):
        restore_variables(directory, build(seed=2, architecture="tiny_h3b32"))


def test_a_packing_table_that_does_not_fit_its_packs_is_an_error(tmp_path, lm):
    directory = written(tmp_path, lm)
    path = os.path.join(directory, STATE_FILE)
    with open(path) as f:
        state = json.load(f)
    name = next(iter(state["packed"]))
    state["packed"][name].pop()
    with open(path, "w") as f:
        json.dump(state, f)
    with pytest.raises(ValueError, match=f"its pack {name} has shape"):
        restore_variables(directory, build(seed=2))
    del state["packed"][name]
    with open(path, "w") as f:
        json.dump(state, f)
    with pytest.raises(ValueError, match="are not those its state.json maps"):
        read_variables(directory)


def test_a_failure_handing_the_write_to_orbax_is_raised_by_wait(tmp_path, lm):
    writer = CheckpointWriter(str(tmp_path), keep=1)

    def refuse(*args, **kwargs):
        raise OSError("no space left on device")

    writer._manager.save = refuse
    assert VariableLayout(lm).copies  # written from the writer's thread
    writer.save(1, lm, {"step": 1})  # returns: the failure comes later
    with pytest.raises(OSError, match="no space left"):
        writer.wait()
    writer.close()
    assert not os.listdir(tmp_path)


def test_non_finite_values_packed_or_not_stop_the_commit(tmp_path, monkeypatch):
    from keras_mhf.pretraining.errors import NonFiniteValues

    monkeypatch.setattr(checkpoint_store, "PACK_BYTES", 1000)
    poisoned = build(seed=3)
    layout = VariableLayout(poisoned)
    packed, single = layout.checked_packed[-1], layout.checked_singles[0]
    for at in (packed, single):
        variable = layout.variables[at]
        value = np.array(keras.ops.convert_to_numpy(variable.value))
        value.reshape(-1)[0] = np.nan
        variable.assign(value)
    writer = CheckpointWriter(str(tmp_path), keep=1)
    writer.save(1, poisoned, {"step": 1})
    with pytest.raises(NonFiniteValues) as raised:
        writer.wait()
    writer.close()
    assert sorted(raised.value.paths) == sorted(
        layout.variables[at].path for at in (packed, single)
    )
    # Not committed (the temporary directory goes with the next writer).
    assert all(TEMPORARY_MARK in name for name in os.listdir(tmp_path))


def test_an_open_writer_drops_only_the_closed_event_loop_report(
    tmp_path, monkeypatch
):
    """A failed Orbax write closes its event loop while other TensorStore
    operations of the write are still running; when they end, TensorStore
    reports `RuntimeError: Event loop is closed` as unraisable (no object),
    which Python prints as a traceback. A writer drops that report, and
    only it, while it is open (and after a failed write, for good)."""
    import sys
    import types

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(
        checkpoint_store,
        "_HOOK",
        {"writers": 0, "failed": False, "previous": None},
    )

    def report(error, obj=None):
        sys.unraisablehook(
            types.SimpleNamespace(
                exc_type=type(error),
                exc_value=error,
                exc_traceback=None,
                err_msg=None,
                object=obj,
            )
        )

    closed = RuntimeError("Event loop is closed")
    writer = CheckpointWriter(str(tmp_path), keep=1)
    report(closed)
    report(RuntimeError("something else"))
    report(closed, obj="a __del__")
    writer.close()
    assert [str(u.exc_value) for u in seen] == [
        "something else",
        "Event loop is closed",
    ]
    assert sys.unraisablehook == seen.append  # restored at close
    report(closed)
    assert len(seen) == 3
