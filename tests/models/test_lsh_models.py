"""Models with LSH heads (`num_lsh > 0`, the authors' ablation): config,
`.keras`, presets, vocabulary expansion and the authors' checkpoints."""

import json
import os

import keras
import numpy as np
import pytest
from keras import ops

from keras_mhf import SignatureTable
from keras_mhf.models import MultiHashFormerBackbone
from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models import count_parameters
from keras_mhf.models import parse_architecture
from tests.conftest import small_proto_bytes
from tests.export.test_authors_checkpoint import write_checkpoint

pytest.importorskip("torch")

IDS = np.array([[1, 17, 5, 33, 80, 2, 9]], "int32")


@pytest.fixture(scope="module")
def tokenizer():
    return MultiHashFormerTokenizer(small_proto_bytes())


@pytest.fixture(scope="module")
def lsh_lm(tokenizer):
    keras.utils.set_random_seed(0)
    return MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b64_lsh1", sequence_length=16
    )


def _outputs(lm):
    inputs = {"token_ids": IDS, "padding_mask": np.ones_like(IDS)}
    return np.asarray(ops.convert_to_numpy(lm(inputs)))


def test_architecture_suffix_builds_the_lsh_table(lsh_lm, tokenizer):
    backbone = lsh_lm.backbone
    assert backbone.num_lsh == 1 and backbone.get_config()["num_lsh"] == 1
    expected = SignatureTable.from_tokens(
        tokenizer.get_vocabulary(),
        3,
        64,
        tokenizer.signature_pad_token_id,
        "unique",
        num_lsh=1,
    )
    np.testing.assert_array_equal(
        backbone.signature_lookup.get_signatures(), expected.signatures
    )
    assert backbone.get_signature_table().num_lsh == 1
    # LSH heads change the table, not the parameters.
    assert count_parameters("tiny_h3b64_lsh1") == count_parameters("tiny_h3b64")
    assert (
        lsh_lm.count_params()
        == MultiHashFormerCausalLM.from_tokenizer(
            tokenizer, "tiny_h3b64"
        ).count_params()
    )
    assert parse_architecture("1b_h4b16k_lsh1")[1]["num_lsh"] == 1
    with pytest.raises(ValueError, match="LSH heads"):
        parse_architecture("tiny_h2b64_lsh3")


def test_config_round_trip_and_old_configs(lsh_lm):
    config = lsh_lm.backbone.get_config()
    rebuilt = MultiHashFormerBackbone.from_config(config)
    assert rebuilt.num_lsh == 1
    config.pop("num_lsh")  # a config written before LSH heads existed
    assert MultiHashFormerBackbone.from_config(config).num_lsh == 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_lsh=-1), "num_lsh"),
        (dict(num_lsh=4), "num_lsh"),
        (dict(num_lsh=1, signature_rule="repeated"), "repeated"),
        (dict(num_lsh=3), "rule='reference'"),
    ],
)
def test_bad_num_lsh_is_refused_by_the_backbone(lsh_lm, overrides, message):
    config = dict(lsh_lm.backbone.get_config(), **overrides)
    with pytest.raises(ValueError, match=message):
        MultiHashFormerBackbone.from_config(config)


def test_keras_file_and_preset_keep_the_lsh_heads(lsh_lm, tmp_path):
    expected = _outputs(lsh_lm)
    path = str(tmp_path / "lsh.keras")
    lsh_lm.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.backbone.num_lsh == 1
    np.testing.assert_allclose(_outputs(loaded), expected, atol=1e-5)
    preset = str(tmp_path / "preset")
    lsh_lm.save_to_preset(preset)
    restored = MultiHashFormerCausalLM.from_preset(preset)  # checks tokenizer
    assert restored.backbone.num_lsh == 1
    np.testing.assert_allclose(_outputs(restored), expected, atol=1e-5)
    # The same weights claiming MurmurHash3-only heads fail the check.
    for name, keys in (
        ("config.json", ["config"]),
        ("task.json", ["config", "backbone", "config"]),
    ):
        with open(os.path.join(preset, name)) as f:
            config = json.load(f)
        inner = config
        for key in keys:
            inner = inner[key]
        inner["num_lsh"] = 0
        with open(os.path.join(preset, name), "w") as f:
            json.dump(config, f)
    with pytest.raises(ValueError, match="hash differently"):
        MultiHashFormerCausalLM.from_preset(preset)


def test_expand_vocabulary_keeps_old_rows(lsh_lm, tokenizer):
    new_tokens = ["▁細胞", "▁cellule", "▁cellules"]
    grown = lsh_lm.expand_vocabulary(new_tokens=new_tokens)
    old = lsh_lm.backbone.signature_lookup.get_signatures()
    rows = grown.backbone.signature_lookup.get_signatures()
    assert grown.backbone.num_lsh == 1
    np.testing.assert_array_equal(rows[: len(old)], old)
    full = SignatureTable.from_tokens(
        tokenizer.get_vocabulary() + new_tokens,
        3,
        64,
        tokenizer.signature_pad_token_id,
        num_lsh=1,
    )
    np.testing.assert_array_equal(rows, full.signatures)


@pytest.mark.parametrize("num_lsh", [1, 3])
def test_authors_lsh_checkpoint_loads_and_is_checked(
    tmp_path, tokenizer, num_lsh
):
    tokens = tokenizer.get_vocabulary()
    ckpt = str(tmp_path / "ckpt")
    tensors = write_checkpoint(
        ckpt,
        tokens,
        pad_token_id=tokenizer.signature_pad_token_id,
        num_lsh=num_lsh,
    )
    # Without a tokenizer the stored hash_map is used as is.
    bare = MultiHashFormerCausalLM.from_preset(ckpt)
    assert bare.backbone.num_lsh == num_lsh
    np.testing.assert_array_equal(
        bare.backbone.signature_lookup.get_signatures(),
        tensors["model.hash_map"],
    )
    # With one, it is checked against a rebuilt LSH table.
    lm = MultiHashFormerCausalLM.from_preset(ckpt, tokenizer=tokenizer)
    assert lm.backbone.signature_rule == "reference"
    np.testing.assert_allclose(_outputs(lm), _outputs(bare), atol=1e-6)
    # A checkpoint whose config does not say how its hash_map was built is
    # caught by the check.
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    config["num_lsh"] = num_lsh - 1
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="hash differently"):
        MultiHashFormerCausalLM.from_preset(ckpt, tokenizer=tokenizer)
    config["num_lsh"], config["lsh_only_embed"] = num_lsh, True
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="lsh_only_embed"):
        MultiHashFormerCausalLM.from_preset(ckpt)


def test_count_params_prints_signature_statistics(tmp_path, capsys):
    from keras_mhf.cli import inspect as tool

    model = tmp_path / "small.model"
    model.write_bytes(small_proto_bytes())
    tool.main(
        ["tiny_h3b64", "tiny_h3b64_lsh1", "tiny_h2b16_lsh2", "tiny"]
        + ["--signatures", str(model)]
    )
    lines = capsys.readouterr().out.splitlines()
    assert "LSH shared" in lines[0] and len(lines) == 4
    assert lines[1].split()[-2:] == ["-", "-"]  # no LSH heads
    assert lines[2].split()[4] == "1" and lines[3].split()[4] == "2"
