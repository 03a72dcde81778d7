import keras
import numpy as np
import pytest
from keras import ops
from keras_hub.src.tests.test_case import TestCase

from keras_mhf import SignatureTable
from keras_mhf.models import MultiHashFormerBackbone
from keras_mhf.utils.keras_utils import count_trainable_parameters

TOKENS = ["<pad>"] + [f"tok{i}" for i in range(39)]
KWARGS = dict(
    vocabulary_size=40,
    num_hashes=3,
    num_buckets=32,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    hidden_dim=16,
    intermediate_dim=32,
    gate_dim=8,
    mixer_dim=8,
    pad_token_id=0,
)


def make_backbone(**overrides):
    table = SignatureTable.from_tokens(TOKENS, 3, 32, pad_token_id=0)
    return MultiHashFormerBackbone(signatures=table, **{**KWARGS, **overrides})


def inputs(length=6, batch=2):
    ids = (
        np.random.default_rng(0)
        .integers(1, 40, size=(batch, length))
        .astype("int32")
    )
    mask = np.ones((batch, length), "int32")
    mask[1, -2:] = 0
    return {"token_ids": ids, "padding_mask": mask}


class MultiHashFormerBackboneTest(TestCase):
    def test_backbone_basics(self):
        table = SignatureTable.from_tokens(TOKENS, 3, 32, pad_token_id=0)
        self.run_backbone_test(
            cls=MultiHashFormerBackbone,
            init_kwargs={**KWARGS, "signatures": table},
            input_data=inputs(length=6),
            expected_output_shape=(2, 6, 16),
            # Quantization (int8, int4, the bucket tables too, saved and
            # reloaded) is tests/models/test_quantization.py's, on the task.
            run_quantization_check=False,
        )

    def test_saving(self):
        table = SignatureTable.from_tokens(TOKENS, 3, 32, pad_token_id=0)
        self.run_model_saving_test(
            cls=MultiHashFormerBackbone,
            init_kwargs={**KWARGS, "signatures": table},
            input_data=inputs(length=6),
        )


def test_forward_and_variable_lengths():
    backbone = make_backbone()
    for length in (2, 3, 7):
        out = backbone(inputs(length))
        assert tuple(out.shape) == (2, length, 16)
    assert backbone.token_embedding is None


def test_parameters_do_not_depend_on_vocabulary():
    small = make_backbone()
    big_tokens = ["<pad>"] + [f"w{i}" for i in range(999)]
    big = MultiHashFormerBackbone(
        signatures=SignatureTable.from_tokens(
            big_tokens, 3, 32, pad_token_id=0
        ),
        **{**KWARGS, "vocabulary_size": 1000},
    )
    assert count_trainable_parameters(small) == count_trainable_parameters(big)


def test_missing_table_is_refused():
    with pytest.raises(ValueError, match="signature table"):
        MultiHashFormerBackbone(**KWARGS)
    with pytest.raises(ValueError, match="does not match"):
        MultiHashFormerBackbone(
            signatures=SignatureTable.from_tokens(
                TOKENS, 3, 32, pad_token_id=1
            ),
            **KWARGS,
        )


def test_config_round_trip_keeps_outputs(tmp_path):
    backbone = make_backbone()
    config = backbone.get_config()
    assert config["signatures"] is None
    for key in KWARGS:
        assert config[key] == KWARGS[key]
    path = str(tmp_path / "backbone.keras")
    backbone.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_allclose(
        ops.convert_to_numpy(restored(inputs())),
        ops.convert_to_numpy(backbone(inputs())),
        atol=1e-6,
    )
    np.testing.assert_array_equal(
        restored.signature_lookup.get_signatures(),
        backbone.signature_lookup.get_signatures(),
    )


def test_qk_norm_epsilon_follows_backbone():
    backbone = make_backbone(layer_norm_epsilon=2e-6)
    attention = backbone.transformer_layers[0]._self_attention_layer
    assert attention._query_dense_layer_norm.epsilon == 2e-6
    assert attention._key_dense_layer_norm.epsilon == 2e-6
    assert backbone.layer_norm.epsilon == 2e-6


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "bfloat16"])
def test_mixed_precision(policy):
    backbone = make_backbone(dtype=policy)
    out = backbone(inputs())
    assert (
        keras.backend.standardize_dtype(out.dtype)
        == keras.DTypePolicy(policy).compute_dtype
    )
    assert (
        keras.backend.standardize_dtype(
            backbone.signature_lookup.signatures.dtype
        )
        == "int32"
    )
