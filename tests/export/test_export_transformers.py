"""Hugging Face export (`export_to_transformers`): the authors' format for
MultiHashFormer, a stock Qwen3 checkpoint for the Standard baseline, the
tokenizer files, and the write's guarantees (refusals, atomicity)."""

import json
import os
import shutil

import keras
import numpy as np
import pytest
import sentencepiece as spm
from keras import ops
from safetensors import safe_open
from safetensors.numpy import save_file

from keras_mhf.expansion.tokenizer_expansion import expand_sentencepiece
from keras_mhf.export.transformers import hf_exporter
from keras_mhf.export.transformers.safetensors_writer import write_safetensors
from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models import StandardCausalLM
from keras_mhf.models import standard_causal_lm

TEXTS = [
    "The cell is the basic unit of life.",
    "Energy is conserved  in a closed system,\n\nso work and heat balance.",
    "  Water boils at one hundred degrees.",
]
IDS = np.array([[1, 5, 17, 33, 60, 2, 90, 41], [1, 7, 8, 9, 10, 11, 12, 13]])


def read_safetensors(path):
    with safe_open(path, framework="np") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def assert_same_weights(actual, expected):
    """Every weight (the signature table included) equal, by path."""
    expected = {w.path: w for w in expected.weights}
    assert sorted(w.path for w in actual.weights) == sorted(expected)
    for weight in actual.weights:
        np.testing.assert_array_equal(
            ops.convert_to_numpy(ops.cast(weight, "float32")),
            ops.convert_to_numpy(ops.cast(expected[weight.path], "float32")),
        )


@pytest.fixture(scope="module")
def tokenizer(small_proto):
    return MultiHashFormerTokenizer(small_proto)


@pytest.fixture(scope="module")
def mhf(tokenizer):
    keras.utils.set_random_seed(0)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b64", sequence_length=16, num_layers=1
    )
    lm.scoring_temperature = 0.8
    return lm


@pytest.fixture(scope="module")
def mhf_dir(mhf, tmp_path_factory):
    path = tmp_path_factory.mktemp("mhf") / "hf"
    assert mhf.export_to_transformers(str(path)) == str(path)
    return path


@pytest.fixture(scope="module")
def standard(tokenizer):
    keras.utils.set_random_seed(1)
    return standard_causal_lm(
        tokenizer, "tiny", sequence_length=16, num_layers=1
    )


@pytest.fixture(scope="module")
def standard_dir(standard, tmp_path_factory):
    path = tmp_path_factory.mktemp("standard") / "hf"
    standard.export_to_transformers(str(path))
    return path


def test_mhf_round_trip_gives_the_same_log_probs(mhf, mhf_dir):
    assert sorted(os.listdir(mhf_dir)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "modeling_multi_hash_former.py",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    loaded = MultiHashFormerCausalLM.from_preset(str(mhf_dir))
    assert loaded.scoring_temperature == pytest.approx(0.8)
    assert loaded.backbone.signature_rule == mhf.backbone.signature_rule
    expected = ops.convert_to_numpy(mhf.score(IDS))
    actual = ops.convert_to_numpy(loaded.score(IDS))
    np.testing.assert_allclose(actual, expected, atol=1e-6, rtol=0)


def test_mhf_keys_shapes_dtypes_and_config(mhf, mhf_dir):
    backbone = mhf.backbone
    H, B, d = backbone.num_hashes, backbone.num_buckets, backbone.hidden_dim
    V, g = backbone.vocabulary_size, backbone.gate_dim
    tensors = read_safetensors(mhf_dir / "model.safetensors")
    expected = {
        "model.hash_map": ((V, H), "int64"),
        "model.embed_tokens.weight": ((H * B, d), "float32"),
        "model.combiner.scorer.0.weight": ((g, d), "float32"),
        "model.combiner.scorer.0.bias": ((g,), "float32"),
        "model.combiner.scorer.2.weight": ((1, g), "float32"),
        "model.combiner.scorer.2.bias": ((1,), "float32"),
        "model.combiner.output_proj.0.weight": ((d, d), "float32"),
        "model.combiner.output_proj.0.bias": ((d,), "float32"),
        "model.norm.weight": ((d,), "float32"),
    }
    q = backbone.num_query_heads * backbone.head_dim
    kv = backbone.num_key_value_heads * backbone.head_dim
    ff = backbone.intermediate_dim
    hd = backbone.head_dim
    for n in range(backbone.num_layers):
        p = f"model.layers.{n}."
        expected.update(
            {
                p + "self_attn.q_proj.weight": ((q, d), "float32"),
                p + "self_attn.k_proj.weight": ((kv, d), "float32"),
                p + "self_attn.v_proj.weight": ((kv, d), "float32"),
                p + "self_attn.o_proj.weight": ((d, q), "float32"),
                p + "self_attn.q_norm.weight": ((hd,), "float32"),
                p + "self_attn.k_norm.weight": ((hd,), "float32"),
                p + "mlp.gate_proj.weight": ((ff, d), "float32"),
                p + "mlp.up_proj.weight": ((ff, d), "float32"),
                p + "mlp.down_proj.weight": ((d, ff), "float32"),
                p + "input_layernorm.weight": ((d,), "float32"),
                p + "post_attention_layernorm.weight": ((d,), "float32"),
            }
        )
    m = backbone.mixer_dim
    for k in range(H - 1):
        p = f"hash_head.cascade_mixer.{k}."
        expected.update(
            {
                p + "0.weight": ((m, 2 * d), "float32"),
                p + "0.bias": ((m,), "float32"),
                p + "2.weight": ((d, m), "float32"),
                p + "2.bias": ((d,), "float32"),
            }
        )
    assert {k: (v.shape, str(v.dtype)) for k, v in tensors.items()} == expected
    np.testing.assert_array_equal(
        tensors["model.hash_map"],
        backbone.signature_lookup.get_signatures(),
    )
    np.testing.assert_array_equal(
        tensors["model.embed_tokens.weight"][B : 2 * B],
        ops.convert_to_numpy(backbone.hash_encoder.embeddings[1]),
    )
    np.testing.assert_array_equal(  # torch [out, in]
        tensors["model.combiner.scorer.0.weight"],
        ops.convert_to_numpy(backbone.hash_encoder.gate_dense.kernel).T,
    )
    config = json.loads((mhf_dir / "config.json").read_text())
    assert config["architectures"] == ["MultiHashFormerForCausalLM"]
    assert config["model_type"] == "multi_hash_former"
    assert config["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_multi_hash_former.MultiHashFormerForCausalLM"
    )
    assert (config["num_hashes"], config["num_buckets"]) == (H, B)
    assert config["num_lsh"] == 0 and config["bottle_neck_dim"] == g
    assert config["use_conditional_prob"] is True
    assert config["tie_word_embeddings"] is True
    assert config["pad_token_id"] == backbone.pad_token_id == 2
    assert config["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
    }
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation = json.loads((mhf_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_standard_round_trip(standard, standard_dir):
    loaded = StandardCausalLM.from_preset(str(standard_dir))
    np.testing.assert_allclose(
        ops.convert_to_numpy(loaded.score(IDS)),
        ops.convert_to_numpy(standard.score(IDS)),
        atol=1e-6,
        rtol=0,
    )
    tensors = read_safetensors(standard_dir / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].shape == (
        standard.backbone.vocabulary_size,
        standard.backbone.hidden_dim,
    )
    assert "lm_head.weight" not in tensors


def test_standard_loads_in_transformers_with_the_same_logits(
    standard, standard_dir
):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(standard_dir))
    with torch.no_grad():
        logits = model(torch.tensor(IDS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(
        logits, ops.convert_to_numpy(standard.score(IDS)), atol=1e-5, rtol=0
    )


def test_mhf_loads_in_stock_transformers(mhf, mhf_dir, tmp_path):
    """With transformers alone: AutoConfig, AutoModelForCausalLM and
    AutoTokenizer load the export; logits are the Keras model's log-probs
    (paper rule, or calibrated on request); greedy generation gives Keras'
    tokens; save_pretrained round trips; without trust_remote_code the
    folder is refused, never built as a stock Qwen3."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    path = str(mhf_dir)
    config = transformers.AutoConfig.from_pretrained(
        path, trust_remote_code=True
    )
    assert type(config).__name__ == "MultiHashFormerConfig"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, output_loading_info=True
    )
    assert type(model).__name__ == "MultiHashFormerForCausalLM"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys"))
    ids = torch.tensor(IDS, dtype=torch.long)
    calibrated = ops.convert_to_numpy(mhf.score(IDS))  # temperature 0.8
    mhf.scoring_temperature = 1.0
    try:
        paper_rule = ops.convert_to_numpy(mhf.score(IDS))
    finally:
        mhf.scoring_temperature = 0.8
    with torch.no_grad():
        logits = model(ids).logits.numpy()
        loss = model(ids, labels=ids).loss
    np.testing.assert_allclose(logits, paper_rule, atol=1e-5, rtol=0)
    expected_loss = -np.mean(
        np.take_along_axis(paper_rule[:, :-1], IDS[:, 1:, None], -1)
    )
    np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5)
    on_request = transformers.AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, apply_scoring_temperature=True
    )
    with torch.no_grad():
        np.testing.assert_allclose(
            on_request(ids).logits.numpy(), calibrated, atol=1e-5, rtol=0
        )
    # Greedy generation with the KV cache: Keras' tokens.
    prompt = auto_tokenizer(mhf_dir)("The cell is", return_tensors="pt")
    n = prompt.input_ids.shape[1]
    with torch.no_grad():
        greedy = model.generate(
            prompt.input_ids, max_new_tokens=6, do_sample=False
        )
        # Sampling may draw the end-of-sequence token; min_new_tokens masks
        # it so the length is known, and the seed makes the draw repeatable.
        torch.manual_seed(0)
        sampled = model.generate(
            prompt.input_ids,
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=True,
            top_k=5,
        )
    assert sampled.shape == (1, n + 6)
    keras_ids = np.asarray(prompt.input_ids.numpy(), "int32")
    # A copy of the model (generation builds decoding state on the model).
    keras_lm = MultiHashFormerCausalLM.from_preset(path)
    keras_lm.preprocessor = None
    keras_lm.compile(sampler="greedy")
    ours = keras_lm.generate(
        {
            "token_ids": np.pad(keras_ids, ((0, 0), (0, 6))),
            "padding_mask": np.pad(np.ones_like(keras_ids), ((0, 0), (0, 6))),
        },
        stop_token_ids=None,
    )
    assert greedy.numpy().tolist() == np.asarray(ours["token_ids"]).tolist()
    # save_pretrained writes a folder that loads to the same numbers.
    model.save_pretrained(str(tmp_path / "saved"))
    again = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "saved"), trust_remote_code=True
    )
    with torch.no_grad():
        np.testing.assert_array_equal(again(ids).logits.numpy(), logits)
    # Without trust_remote_code: refused, not a stock Qwen3 of the tables.
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(
            path, trust_remote_code=False
        )


def auto_tokenizer(path):
    transformers = pytest.importorskip("transformers")
    try:
        # trust_remote_code: a model folder's config names our code; without
        # it transformers asks on stdin.
        return transformers.AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=True
        )
    except Exception as error:  # e.g. a backend missing offline
        pytest.skip(f"AutoTokenizer cannot be built here: {error}")


def test_exported_tokenizer_gives_our_ids(tokenizer, mhf_dir):
    hf = auto_tokenizer(mhf_dir)
    for text in TEXTS:
        ours = [1] + [int(i) for i in ops.convert_to_numpy(tokenizer(text))]
        assert hf(text)["input_ids"] == ours


def test_exported_mistral_tokenizer_matches_sentencepiece(
    mistral_model_path, tmp_path
):
    path = MultiHashFormerTokenizer(mistral_model_path).export_to_transformers(
        str(tmp_path / "tokenizer")
    )
    hf = auto_tokenizer(path)
    sp = spm.SentencePieceProcessor(model_file=mistral_model_path)
    texts = TEXTS + [
        "The mitochondria is",
        "细胞是生命的基本单位。 émoji 🤖\ttab",
        "<s> [INST] literal control text",
    ]
    assert hf("The mitochondria is")["input_ids"] == [
        1,
        1183,
        3135,
        4810,
        1857,
        4699,
        1117,
    ]
    for text in texts:
        assert hf(text)["input_ids"] == [1] + sp.encode(text)


def test_existing_directory_is_refused_unless_overwrite(mhf, tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    (path / "old.txt").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        mhf.export_to_transformers(str(path))
    assert os.listdir(path) == ["old.txt"]
    mhf.backbone.export_to_transformers(str(path), overwrite=True)
    assert "old.txt" not in os.listdir(path)
    assert "tokenizer.model" not in os.listdir(path)  # backbone only


def test_failed_write_leaves_no_partial_directory(mhf, tmp_path, monkeypatch):
    def fail(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(hf_exporter, "write_tokenizer", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        mhf.export_to_transformers(str(tmp_path / "new"))
    assert os.listdir(tmp_path) == []  # no directory, no staging left
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("previous export")
    with pytest.raises(RuntimeError, match="disk full"):
        mhf.export_to_transformers(str(old), overwrite=True)
    assert os.listdir(tmp_path) == ["old"]
    assert (old / "keep.txt").read_text() == "previous export"


def test_quantized_model_is_refused(tokenizer, tmp_path):
    lm = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b64", sequence_length=16, num_layers=1
    )
    lm.backbone.quantize_hash_tables("int8")
    with pytest.raises(ValueError, match="quantized"):
        lm.export_to_transformers(str(tmp_path / "q"))
    assert not (tmp_path / "q").exists()


def test_expanded_vocabulary_exports_its_grown_table(
    mhf, small_proto, tmp_path
):
    new_proto, pieces = expand_sentencepiece(
        small_proto, {"zh": ["细胞是生命的基本单位。"] * 5}, 10
    )
    (tmp_path / "new.model").write_bytes(new_proto)
    grown = mhf.expand_vocabulary(
        tokenizer=MultiHashFormerTokenizer(str(tmp_path / "new.model"))
    )
    # expand_sentencepiece adds "▁细" but not "细": SentencePiece can form
    # it, Hugging Face BPE cannot, and the export says so.
    with pytest.warns(UserWarning, match="not itself a piece"):
        path = grown.export_to_transformers(str(tmp_path / "hf"))
    tensors = read_safetensors(os.path.join(path, "model.safetensors"))
    V = mhf.backbone.vocabulary_size
    assert tensors["model.hash_map"].shape == (V + len(pieces), 3)
    np.testing.assert_array_equal(
        tensors["model.hash_map"][:V],
        mhf.backbone.signature_lookup.get_signatures(),
    )
    loaded = MultiHashFormerCausalLM.from_preset(path)
    assert_same_weights(loaded, grown)  # the table included
    hf = auto_tokenizer(path)
    text = "The cell is 是生命"
    ours = [1] + [
        int(i) for i in ops.convert_to_numpy(grown.preprocessor.tokenizer(text))
    ]
    assert hf(text)["input_ids"] == ours


def test_cli_export_writes_transformers(mhf, tmp_path):
    from keras_mhf.cli import export as tool

    mhf.save_to_preset(str(tmp_path / "preset"))
    tool.main(
        [
            "--format",
            "transformers",
            "--preset",
            str(tmp_path / "preset"),
            "--output",
            str(tmp_path / "hf"),
        ]
    )
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert (
        json.loads((tmp_path / "hf" / "config.json").read_text())["num_hashes"]
        == mhf.backbone.num_hashes
    )


def test_bfloat16_weights_are_written_and_read(mhf, mhf_dir, tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    array = np.arange(6, dtype="float32").reshape(2, 3).astype(bf16)
    write_safetensors(
        str(tmp_path / "x.safetensors"),
        [("w", (2, 3), "bfloat16", lambda: array)],
    )
    read = read_safetensors(tmp_path / "x.safetensors")["w"]
    assert str(read.dtype) == "bfloat16"
    np.testing.assert_array_equal(read, array)
    # An authors' checkpoint in bfloat16 (as they release theirs) loads.
    directory = tmp_path / "bf16"
    directory.mkdir()
    for name in os.listdir(mhf_dir):
        if name != "model.safetensors":
            (directory / name).write_bytes((mhf_dir / name).read_bytes())
    tensors = read_safetensors(mhf_dir / "model.safetensors")
    save_file(
        {
            k: v if v.dtype == np.int64 else v.astype(bf16)
            for k, v in tensors.items()
        },
        str(directory / "model.safetensors"),
    )
    loaded = MultiHashFormerCausalLM.from_preset(str(directory))
    expected = {w.path: w for w in mhf.weights}
    for weight in loaded.weights:
        value = ops.convert_to_numpy(expected[weight.path])
        if value.dtype.kind == "f":
            value = value.astype(bf16).astype("float32")
        np.testing.assert_array_equal(ops.convert_to_numpy(weight), value)


def test_imported_tokenizer_files_must_agree(mhf_dir, tmp_path):
    replaced = tmp_path / "replaced"
    shutil.copytree(mhf_dir, replaced)
    tokenizer_json = json.loads((replaced / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (replaced / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(
        ValueError,
        match=r"tokenizer.json and .*tokenizer.model disagree: token 10",
    ):
        MultiHashFormerCausalLM.from_preset(str(replaced))
    # Without tokenizer.model: loaded for token ids, with a warning.
    (replaced / "tokenizer.model").unlink()
    with pytest.warns(
        UserWarning,
        match="has no tokenizer.model .*tokenizer.json is not read.*without a tokenizer",
    ):
        bare = MultiHashFormerCausalLM.from_preset(str(replaced))
    assert bare.preprocessor is None


def test_a_transposed_tensor_is_named_with_both_shapes(mhf_dir, tmp_path):
    import safetensors.numpy

    swapped = tmp_path / "swapped"
    shutil.copytree(mhf_dir, swapped)
    tensors = safetensors.numpy.load_file(str(swapped / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    rows, columns = tensors[key].shape
    tensors[key] = np.ascontiguousarray(tensors[key].T)
    safetensors.numpy.save_file(
        tensors, str(swapped / "model.safetensors"), metadata={"format": "pt"}
    )
    with pytest.raises(
        ValueError,
        match=rf"down_proj.weight' has shape \({columns}, {rows}\), which "
        rf"converts to \({rows}, {columns}\), not the Keras variable's "
        rf"\({columns}, {rows}\): the tensor is stored transposed",
    ):
        MultiHashFormerCausalLM.from_preset(str(swapped))


def test_a_lora_model_is_exported_with_its_adapters_merged(tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    keras.utils.set_random_seed(2)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b64", sequence_length=16, num_layers=1
    )
    lm.backbone.enable_lora(4)
    rng = np.random.default_rng(0)
    for weight in lm.weights:
        if "lora" in weight.path:
            weight.assign(0.1 * rng.normal(size=weight.shape).astype("float32"))
    expected = ops.convert_to_numpy(lm.score(IDS))
    lm.export_to_transformers(str(tmp_path / "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), trust_remote_code=True
    )
    with torch.no_grad():
        logits = model(torch.tensor(IDS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
