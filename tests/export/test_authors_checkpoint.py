import json
import os

import numpy as np
import pytest
from keras import ops
from safetensors.numpy import save_file

from keras_mhf import SignatureTable
from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import StandardCausalLM
from tests.conftest import assert_greedy_continuation
from tests.numpy_reference import authors_model_bucket_logits

CFG = dict(
    layers=2,
    d=32,
    nq=4,
    nkv=2,
    hd=8,
    ff=48,
    num_hashes=3,
    num_buckets=64,
    g=8,
    eps=1e-6,
    theta=1_000_000.0,
)


def write_checkpoint(
    directory,
    tokens,
    pad_token_id=2,
    seed=0,
    drop=None,
    reshape=None,
    num_lsh=0,
):
    """A tiny checkpoint in the authors' format, random weights (torch [out,
    in]); `num_lsh` LSH heads in its hash_map and config."""
    rng = np.random.default_rng(seed)
    c = CFG
    d, H, B, g = c["d"], c["num_hashes"], c["num_buckets"], c["g"]

    def normal(*shape):
        return (rng.normal(size=shape) * 0.2).astype("float32")

    table = SignatureTable.from_tokens(
        tokens, H, B, pad_token_id, "reference", num_lsh=num_lsh
    )
    t = {
        "model.hash_map": table.signatures.astype("int64"),
        "model.embed_tokens.weight": normal(H * B, d),
        "model.combiner.scorer.0.weight": normal(g, d),
        "model.combiner.scorer.0.bias": normal(g),
        "model.combiner.scorer.2.weight": normal(1, g),
        "model.combiner.scorer.2.bias": normal(1),
        "model.combiner.output_proj.0.weight": normal(d, d),
        "model.combiner.output_proj.0.bias": normal(d),
        "model.norm.weight": 1 + normal(d),
    }
    t["lm_head.weight"] = t["model.embed_tokens.weight"]
    for n in range(c["layers"]):
        p = f"model.layers.{n}."
        t.update(
            {
                p + "self_attn.q_proj.weight": normal(c["nq"] * c["hd"], d),
                p + "self_attn.k_proj.weight": normal(c["nkv"] * c["hd"], d),
                p + "self_attn.v_proj.weight": normal(c["nkv"] * c["hd"], d),
                p + "self_attn.o_proj.weight": normal(d, c["nq"] * c["hd"]),
                p + "self_attn.q_norm.weight": 1 + normal(c["hd"]),
                p + "self_attn.k_norm.weight": 1 + normal(c["hd"]),
                p + "mlp.gate_proj.weight": normal(c["ff"], d),
                p + "mlp.up_proj.weight": normal(c["ff"], d),
                p + "mlp.down_proj.weight": normal(d, c["ff"]),
                p + "input_layernorm.weight": 1 + normal(d),
                p + "post_attention_layernorm.weight": 1 + normal(d),
            }
        )
    for k in range(H - 1):
        p = f"hash_head.cascade_mixer.{k}."
        t.update(
            {
                p + "0.weight": normal(g, 2 * d),
                p + "0.bias": normal(g),
                p + "2.weight": normal(d, g),
                p + "2.bias": normal(d),
            }
        )
    if drop:
        t.pop(drop)
    if reshape:
        t[reshape] = t[reshape][..., :-1].copy()
    os.makedirs(directory, exist_ok=True)
    # safetensors refuses shared tensors: store the tied head as a copy.
    t["lm_head.weight"] = t["lm_head.weight"].copy()
    save_file(t, os.path.join(directory, "model.safetensors"))
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": d,
        "num_hidden_layers": c["layers"],
        "num_attention_heads": c["nq"],
        "num_key_value_heads": c["nkv"],
        "head_dim": c["hd"],
        "intermediate_size": c["ff"],
        "rms_norm_eps": c["eps"],
        "vocab_size": len(tokens),
        "num_hashes": H,
        "num_buckets": B,
        "num_lsh": num_lsh,
        "bottle_neck_dim": g,
        "pad_token_id": pad_token_id,
        "rope_parameters": {"rope_theta": c["theta"], "rope_type": "default"},
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return t


def test_converted_model_matches_numpy_equations(tmp_path, small_tokenizer):
    tokens = small_tokenizer.get_vocabulary()
    tensors = write_checkpoint(str(tmp_path / "ckpt"), tokens)
    lm = MultiHashFormerCausalLM.from_preset(
        str(tmp_path / "ckpt"), tokenizer=small_tokenizer
    )
    assert lm.backbone.signature_rule == "reference"
    ids = np.array([[1, 17, 5, 33, 80, 2, 9]], dtype="int32")
    got = np.asarray(
        ops.convert_to_numpy(
            lm({"token_ids": ids, "padding_mask": np.ones_like(ids)})
        )
    )
    cfg = dict(CFG, nq=CFG["nq"], nkv=CFG["nkv"], hd=CFG["hd"])
    expected = authors_model_bucket_logits(
        ids[0],
        {
            k: v.astype("float64") if v.dtype != np.int64 else v
            for k, v in tensors.items()
        },
        cfg,
    )
    np.testing.assert_allclose(got[0], expected, atol=1e-5, rtol=1e-5)
    assert_greedy_continuation(lm)  # generation reads the converted weights


def test_tokenizer_that_does_not_match_hash_map_is_refused(
    tmp_path, small_tokenizer
):
    tokens = list(small_tokenizer.get_vocabulary())
    tokens[40], tokens[41] = tokens[41], tokens[40]
    write_checkpoint(str(tmp_path / "ckpt"), tokens)
    with pytest.raises(ValueError, match="hash differently"):
        MultiHashFormerCausalLM.from_preset(
            str(tmp_path / "ckpt"), tokenizer=small_tokenizer
        )


def test_missing_key_is_named(tmp_path):
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(20)]
    write_checkpoint(
        str(tmp_path / "ckpt"), tokens, drop="hash_head.cascade_mixer.1.2.bias"
    )
    with pytest.raises(ValueError, match="hash_head.cascade_mixer.1.2.bias"):
        MultiHashFormerCausalLM.from_preset(str(tmp_path / "ckpt"))


def test_misshaped_tensor_is_named_with_expected_shape(tmp_path):
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(20)]
    write_checkpoint(
        str(tmp_path / "ckpt"),
        tokens,
        reshape="model.layers.1.mlp.down_proj.weight",
    )
    with pytest.raises(
        ValueError, match=r"layers.1.mlp.down_proj.weight.*\(48, 32\)"
    ):
        MultiHashFormerCausalLM.from_preset(str(tmp_path / "ckpt"))
    # The stacked bucket tables are split over H per-head variables.
    write_checkpoint(
        str(tmp_path / "ckpt2"), tokens, reshape="model.embed_tokens.weight"
    )
    expected = (
        r"embed_tokens.weight.*\("
        rf"{CFG['num_hashes'] * CFG['num_buckets']}, {CFG['d']}\)"
    )
    with pytest.raises(ValueError, match=expected):
        MultiHashFormerCausalLM.from_preset(str(tmp_path / "ckpt2"))


def test_malformed_config_and_pickles_are_refused(tmp_path):
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(20)]
    ckpt = str(tmp_path / "ckpt")
    write_checkpoint(ckpt, tokens)
    config_path = os.path.join(ckpt, "config.json")
    config = json.load(open(config_path))
    del config["num_buckets"]
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ValueError, match="num_buckets"):
        MultiHashFormerCausalLM.from_preset(ckpt)
    config["num_buckets"] = 64
    # Without num_hashes it is still this model's checkpoint (its other
    # fields say so): the missing field is named, not a KerasHub file, and
    # the Standard baseline does not take it for a stock Qwen3.
    del config["num_hashes"]
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ValueError, match=r"missing .*\['num_hashes'\]"):
        MultiHashFormerCausalLM.from_preset(ckpt)
    with pytest.raises(ValueError, match="MultiHashFormerCausalLM.from_pre"):
        StandardCausalLM.from_preset(ckpt)
    config["num_hashes"] = CFG["num_hashes"]
    config["num_lsh"] = 4  # more LSH heads than heads
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ValueError, match="num_lsh"):
        MultiHashFormerCausalLM.from_preset(ckpt)
    config["num_lsh"] = 0
    json.dump(config, open(config_path, "w"))
    os.remove(os.path.join(ckpt, "model.safetensors"))
    open(os.path.join(ckpt, "pytorch_model.bin"), "wb").write(b"not read")
    with pytest.raises(ValueError, match="safetensors only"):
        MultiHashFormerCausalLM.from_preset(ckpt)


def _tokens():
    return ["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(37)]


def test_config_with_fewer_layers_than_the_file_is_refused(tmp_path):
    """Tensors the config does not account for are an error, never silently
    dropped."""
    write_checkpoint(str(tmp_path), _tokens())
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not account for.*layers.1"):
        MultiHashFormerCausalLM.from_preset(str(tmp_path))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_is_reported_as_corrupt(tmp_path, damage):
    write_checkpoint(str(tmp_path), _tokens())
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(
        data[: len(data) // 2] if damage == "truncated" else b"\x00" * 64
    )
    with pytest.raises(ValueError, match="corrupt or truncated"):
        MultiHashFormerCausalLM.from_preset(str(tmp_path))


@pytest.mark.parametrize(
    "key, dtype, message",
    [
        ("model.embed_tokens.weight", "int32", "must be floating point"),
        (
            "model.layers.0.mlp.up_proj.weight",
            "int32",
            "must be floating point",
        ),
        ("model.hash_map", "float32", "integer bucket ids"),
    ],
)
def test_wrong_dtypes_are_refused(tmp_path, key, dtype, message):
    from safetensors.numpy import load_file

    write_checkpoint(str(tmp_path), _tokens())
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    tensors[key] = tensors[key].astype(dtype)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=message):
        MultiHashFormerCausalLM.from_preset(str(tmp_path))
