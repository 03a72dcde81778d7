"""`.keras` files of our models: written whole or not at all, and a cut-short
one is named as damaged when `load_causal_lm` reads it."""

import os

import keras
import numpy as np
import pytest

from keras_mhf.models import load_causal_lm


def test_a_keras_file_is_written_whole_or_not_at_all(
    tiny_lm, tmp_path, monkeypatch
):
    path = tmp_path / "model.keras"
    tiny_lm.save(path)
    whole = path.read_bytes()
    assert os.listdir(tmp_path) == ["model.keras"]

    def fails_half_way(self, filepath, *args, **kwargs):
        with open(filepath, "wb") as f:
            f.write(whole[: len(whole) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(keras.Model, "save", fails_half_way)
    with pytest.raises(OSError, match="No space left"):
        tiny_lm.save(path)
    # The older file is whole, and no temporary file is left.
    assert path.read_bytes() == whole
    assert os.listdir(tmp_path) == ["model.keras"]


def test_a_cut_short_keras_file_is_named_as_damaged(tiny_lm, tmp_path):
    path = tmp_path / "model.keras"
    tiny_lm.save(path)
    loaded = load_causal_lm(str(path))
    assert type(loaded) is type(tiny_lm)
    for ours, theirs in zip(loaded.get_weights(), tiny_lm.get_weights()):
        np.testing.assert_array_equal(ours, theirs)
    cut = tmp_path / "cut.keras"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="cut.keras is damaged or cut short"):
        load_causal_lm(str(cut))
