"""A model built with a mixed dtype policy saves a preset that every loader
reads back with that policy and the same numbers (KerasHub's loader alone
fails on `mixed_bfloat16`)."""

import json

import keras
import keras_hub
import numpy as np
from keras import ops

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import StandardCausalLM
from keras_mhf.models import standard_causal_lm


def test_mixed_precision_presets_round_trip(small_tokenizer, tmp_path):
    keras.utils.set_random_seed(0)
    mhf = MultiHashFormerCausalLM.from_tokenizer(
        small_tokenizer, "tiny_h3b64", sequence_length=8, dtype="mixed_bfloat16"
    )
    standard = standard_causal_lm(
        small_tokenizer, "tiny", sequence_length=8, dtype="mixed_bfloat16"
    )
    ids = np.array([[1, 5, 9, 13, 7, 2]])
    for lm, cls in (
        (mhf, MultiHashFormerCausalLM),
        (standard, StandardCausalLM),
    ):
        path = tmp_path / cls.__name__
        lm.save_to_preset(str(path))
        saved = json.loads((path / "config.json").read_text())["config"]
        assert saved["dtype"]["config"]["default_policy"] == "mixed_bfloat16"
        expected = np.asarray(ops.convert_to_numpy(lm.score(ids)))
        for load in (cls.from_preset, keras_hub.models.CausalLM.from_preset):
            again = load(str(path))
            assert type(again) is cls
            assert again.backbone.dtype_policy.name == "mixed_bfloat16"
            assert again.backbone.compute_dtype == "bfloat16"
            assert any(
                layer.dtype_policy.name == "mixed_bfloat16"
                for layer in again.backbone.layers
            )
            np.testing.assert_array_equal(
                np.asarray(ops.convert_to_numpy(again.score(ids))), expected
            )
        # Saved again, it loads again (the round trip is stable).
        again.save_to_preset(str(tmp_path / "again"))
        assert (
            load(str(tmp_path / "again")).backbone.compute_dtype == "bfloat16"
        )
        # An explicit dtype still wins.
        as_float = cls.from_preset(str(path), dtype="float32")
        assert as_float.backbone.compute_dtype == "float32"
