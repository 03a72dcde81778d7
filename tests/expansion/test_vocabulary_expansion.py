import importlib.util
import json

import numpy as np
import pytest
import sentencepiece as spm
from keras import ops

from keras_mhf.expansion.tokenizer_expansion import expand_sentencepiece
from keras_mhf.expansion.tokenizer_expansion import expand_standard_vocabulary
from keras_mhf.expansion.tokenizer_expansion import (
    freeze_for_continual_pretraining,
)
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models import standard_causal_lm
from tests.conftest import DATA
from tests.conftest import REPO
from tests.conftest import assert_greedy_continuation
from tests.conftest import run_script

NEW_TEXTS = {
    "zh": [
        "细胞是生命的基本单位。",
        "水在海平面一百度沸腾。",
        "光比声音传播得快。",
    ]
    * 5,
    "hi": ["कोशिका जीवन की मूल इकाई है।", "पानी सौ डिग्री पर उबलता है।"] * 5,
    "ar": ["الخلية هي الوحدة الأساسية للحياة.", "الماء يغلي عند مائة درجة."]
    * 5,
}


def test_new_pieces_are_appended_and_english_is_unchanged(small_proto, corpus):
    new_proto, pieces = expand_sentencepiece(
        small_proto, NEW_TEXTS, pieces_per_language=30
    )
    old = spm.SentencePieceProcessor(model_proto=small_proto)
    new = spm.SentencePieceProcessor(model_proto=new_proto)
    size = old.get_piece_size()
    assert new.get_piece_size() == size + len(pieces) and 0 < len(pieces) <= 90
    assert [new.id_to_piece(i) for i in range(size)] == [
        old.id_to_piece(i) for i in range(size)
    ]
    assert [new.id_to_piece(size + i) for i in range(len(pieces))] == pieces
    for text in corpus + ["Numbers 123 and symbols %$ stay."]:
        assert new.encode(text) == old.encode(text)
    zh = NEW_TEXTS["zh"][0]
    assert len(new.encode(zh)) < len(
        old.encode(zh)
    ) or old.unk_id() in old.encode(zh)
    assert any(new.id_to_piece(i) in pieces for i in new.encode(zh))


def test_expanded_mhf_model_uses_the_new_tokenizer(
    tiny_lm, small_proto, tmp_path
):
    new_proto, pieces = expand_sentencepiece(
        small_proto, NEW_TEXTS, pieces_per_language=20
    )
    path = tmp_path / "new.model"
    path.write_bytes(new_proto)
    grown = tiny_lm.expand_vocabulary(
        tokenizer=MultiHashFormerTokenizer(str(path))
    )
    assert (
        grown.backbone.vocabulary_size
        == tiny_lm.backbone.vocabulary_size + len(pieces)
    )
    # The prompt is read with the new pieces, and the grown model generates
    # from them with its own scores.
    ids, start = assert_greedy_continuation(grown, "细胞")
    assert max(ids[:start]) >= tiny_lm.backbone.vocabulary_size
    # A tokenizer that lacks the model's current pieces is refused.
    with pytest.raises(ValueError, match="does not start with"):
        grown.expand_vocabulary(tokenizer=MultiHashFormerTokenizer(small_proto))


def test_standard_mean_initialisation(small_tokenizer, small_proto, tmp_path):
    model = standard_causal_lm(small_tokenizer, "tiny", sequence_length=16)
    new_proto, pieces = expand_sentencepiece(
        small_proto, NEW_TEXTS, pieces_per_language=10
    )
    path = tmp_path / "new.model"
    path.write_bytes(new_proto)
    grown = expand_standard_vocabulary(
        model, MultiHashFormerTokenizer(str(path))
    )
    old_rows = ops.convert_to_numpy(model.backbone.token_embedding.embeddings)
    rows = ops.convert_to_numpy(grown.backbone.token_embedding.embeddings)
    np.testing.assert_array_equal(rows[: len(old_rows)], old_rows)
    old_sp = spm.SentencePieceProcessor(model_proto=small_proto)
    piece = pieces[0]
    text = piece.replace("▁", " ")
    ids = (
        old_sp.encode(text.lstrip())
        if text.startswith(" ")
        else old_sp.encode(text)
    )
    if not text.startswith(" ") and ids and old_sp.id_to_piece(ids[0]) == "▁":
        ids = ids[1:]
    np.testing.assert_allclose(
        rows[len(old_rows)], old_rows[ids].mean(0), rtol=1e-6
    )
    added = grown.count_params() - model.count_params()
    assert added == len(pieces) * model.backbone.hidden_dim


def test_freezing_keeps_first_and_last_two_blocks(small_tokenizer):
    model = standard_causal_lm(small_tokenizer, "tiny", extra_layers=4)
    frozen = freeze_for_continual_pretraining(model)
    assert frozen == [2, 3]
    assert [b.trainable for b in model.backbone.transformer_layers] == [
        True,
        True,
        False,
        False,
        True,
        True,
    ]
    assert model.backbone.token_embedding.trainable


def load_recipe(name):
    """`recipes/NAME.py` as a module (recipes/ is not a package)."""
    path = REPO / "recipes" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipe_on_shared_data(tmp_path, mistral_model_path):
    data = DATA / "multilingual_ar_zh_hi"
    from keras_mhf.models import MultiHashFormerCausalLM

    tokenizer = MultiHashFormerTokenizer(mistral_model_path)
    MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b256", sequence_length=32
    ).save_to_preset(str(tmp_path / "mhf"))
    standard_causal_lm(tokenizer, "tiny", sequence_length=32).save_to_preset(
        str(tmp_path / "std")
    )
    arguments = [
        "--mhf",
        str(tmp_path / "mhf"),
        "--standard",
        str(tmp_path / "std"),
        "--data",
        str(data),
        "--output",
        str(tmp_path / "ve"),
        "--pieces-per-language",
        "60",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--sequence-length",
        "32",
        "--max-train-lines",
        "100",
        "--validation-lines",
        "8",
        "--calibration-lines",
        "2",
        "--eval-every",
        "2",
        "--seeds",
        "2",
        "--max-length",
        "32",
        "--curve-seeds",
        "1",
        "--work-dir",
        str(tmp_path / "work"),
    ]
    run_script("recipes/expand_vocabulary.py", *arguments, timeout=900)
    out = tmp_path / "ve"
    report = json.loads((out / "report.json").read_text())
    assert report["tokenizer"]["english_lines_changed"] == 0
    assert report["tokenizer"]["new_vocabulary"] == 32768 + sum(
        report["tokenizer"]["new_pieces_per_language"].values()
    )
    mhf, std = report["summary"]["mhf"], report["summary"]["std"]
    assert mhf["parameters_added"] == 0
    # Its signature table (and the bucket index derived from it) grow by H
    # integers per new token each.
    assert mhf["integers_added"] == 2 * 3 * (
        report["tokenizer"]["new_vocabulary"] - 32768
    )
    assert std["parameters_added"] > 0
    assert mhf["seeds"] == std["seeds"] == [0, 1]
    for lang in ("ar", "zh", "hi", "en"):
        row = mhf["languages"][lang]
        assert np.isfinite(row["after"][0]) and np.isfinite(
            row["after_paper_rule"][0]
        )
        # The new pieces shorten the new languages' text, never English's.
        tpc = report["tokens_per_character"][lang]
        if lang == "en":
            assert tpc["new"] == tpc["old"]
        else:
            assert tpc["new"] < tpc["old"]
    # Seed 0's curve: right after the expansion, then every 2 steps; seed 1
    # is scored at the end only.
    runs = report["models"]["mhf"]["runs"]
    assert [p["step"] for p in runs[0]["curve"]] == [0, 2]
    assert [p["step"] for p in runs[1]["curve"]] == [2]
    assert "| mhf | " in (out / "report.md").read_text()
    assert (out / "curves.png").stat().st_size > 0
    assert (
        tmp_path / "work" / "mhf" / "seed1" / "preset" / "config.json"
    ).exists()
    # Finished runs are read back, not run again (in this process: the
    # command line ran above).
    arguments[arguments.index(str(out))] = str(tmp_path / "again")
    recipe = load_recipe("expand_vocabulary")
    recipe.main(arguments + ["--report-only"])
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    for name in ("mhf", "std"):
        assert (
            again["summary"][name]["languages"]
            == (report["summary"][name]["languages"])
        )
    # The base MHF is also scored with the temperature its preset ships.
    assert again["summary"]["mhf"]["shipped_temperature"] == 1.0
