"""Presets and tokenizers that disagree with the model are refused; presets
and `.keras` files saved by keras_mhf 0.1 still load and give their numbers.
"""

import json
import shutil

import keras
import keras_hub
import numpy as np
import pytest
from keras import ops
from sentencepiece import sentencepiece_model_pb2

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerCausalLMPreprocessor
from keras_mhf.models import MultiHashFormerTokenizer
from keras_mhf.models import StandardCausalLM
from keras_mhf.models import standard_causal_lm
from keras_mhf.models.multi_hash_former.multi_hash_former_vocabulary import (
    tokenization_fingerprint,
)
from tests.conftest import DATA

LEGACY = DATA / "legacy_v0_1"


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


@pytest.fixture(scope="module")
def presets(small_proto, tmp_path_factory):
    """One MHF preset (with its tokenizer's fingerprint), one Standard
    preset and one MHF preset without a preprocessor, saved once."""
    root = tmp_path_factory.mktemp("presets")
    tokenizer = MultiHashFormerTokenizer(small_proto)
    keras.utils.set_random_seed(0)
    mhf = MultiHashFormerCausalLM.from_tokenizer(
        tokenizer, "tiny_h3b64", sequence_length=8
    )
    mhf.save_to_preset(str(root / "mhf"))
    standard = standard_causal_lm(tokenizer, "tiny", sequence_length=8)
    standard.save_to_preset(str(root / "standard"))
    MultiHashFormerCausalLM(mhf.backbone, preprocessor=None).save_to_preset(
        str(root / "bare")
    )
    return root


def edited_copy(source, target, file, **changes):
    shutil.copytree(source, target)
    path = target / file
    serialized = json.loads(path.read_text())
    config = serialized["config"]
    if file == "task.json":
        config = config["backbone"]["config"]
    config.update(changes)
    path.write_text(json.dumps(serialized))
    return str(target)


@pytest.mark.parametrize(
    "changes",
    [
        {"num_hashes": 4, "hidden_dim": 48},
        {"num_buckets": 128, "vocabulary_size": 121},
    ],
)
def test_config_json_edited_apart_from_task_json_is_refused(
    presets, tmp_path, changes
):
    preset = edited_copy(
        presets / "mhf", tmp_path / "edited", "config.json", **changes
    )
    task = json.loads((presets / "mhf" / "task.json").read_text())
    saved = task["config"]["backbone"]["config"]
    for load in (
        MultiHashFormerCausalLM.from_preset,
        keras_hub.models.CausalLM.from_preset,
        keras_hub.models.Backbone.from_preset,
    ):
        with pytest.raises(ValueError, match="disagrees with itself") as info:
            load(preset)
        message = str(info.value)
        assert "config.json and task.json" in message, message
        for field, value in changes.items():
            assert (
                f"{field}: {value!r} in config.json, {saved[field]!r} in "
                "task.json"
            ) in message, message


def test_standard_and_preprocessor_files_edited_apart_are_refused(
    presets, tmp_path
):
    standard = edited_copy(
        presets / "standard", tmp_path / "standard", "config.json", num_layers=3
    )
    for load in (
        StandardCausalLM.from_preset,
        keras_hub.models.CausalLM.from_preset,
    ):
        with pytest.raises(ValueError, match="num_layers: 3 in config.json"):
            load(standard)
    # A preset without a preprocessor is checked when its weights load.
    bare = edited_copy(
        presets / "bare", tmp_path / "bare", "config.json", num_buckets=128
    )
    with pytest.raises(ValueError, match="num_buckets: 128 in config.json"):
        keras_hub.models.CausalLM.from_preset(bare)
    # preprocessor.json against task.json.
    shutil.copytree(presets / "mhf", tmp_path / "sequence")
    path = tmp_path / "sequence" / "preprocessor.json"
    serialized = json.loads(path.read_text())
    serialized["config"]["sequence_length"] = 64
    path.write_text(json.dumps(serialized))
    with pytest.raises(
        ValueError, match="preprocessor.json and task.json describe"
    ):
        keras_hub.models.CausalLM.from_preset(str(tmp_path / "sequence"))


def rescored(proto):
    """The same pieces with the BPE scores reversed (other merge order)."""
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    for piece in model.pieces:
        if piece.type == piece.NORMAL:
            piece.score = -piece.score
    return model.SerializeToString()


def test_a_rescored_tokenizer_is_refused(presets, small_proto):
    """Same pieces (so the same signatures) but other scores: another
    tokenization, which the model's recorded fingerprint catches."""
    original = MultiHashFormerTokenizer(small_proto)
    other = MultiHashFormerTokenizer(rescored(small_proto))
    assert other.get_vocabulary() == original.get_vocabulary()
    text = "The cell"
    assert len(to_numpy(original(text))) < len(to_numpy(other(text)))
    assert tokenization_fingerprint(other) != tokenization_fingerprint(original)

    lm = MultiHashFormerCausalLM.from_preset(str(presets / "mhf"))
    assert lm.backbone.tokenization_fingerprint == (
        tokenization_fingerprint(original)
    )
    lm.check_tokenizer(force=True)  # its own tokenizer, from the preset
    lm.preprocessor = MultiHashFormerCausalLMPreprocessor(
        other, sequence_length=8
    )
    with pytest.raises(ValueError, match="tokenizes differently"):
        lm.generate(text, max_length=8)
    with pytest.raises(ValueError, match="tokenizes differently"):
        lm.score(np.array([[1, 5, 6]]))


def test_fingerprint_covers_tokenization_not_training_options(small_proto):
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(small_proto)
    fingerprint = tokenization_fingerprint(small_proto)
    model.trainer_spec.num_threads = 3
    model.trainer_spec.input.append("other_corpus.txt")
    assert tokenization_fingerprint(model.SerializeToString()) == fingerprint
    changed = []
    for change in (
        lambda m: setattr(m.normalizer_spec, "add_dummy_prefix", False),
        lambda m: setattr(m.trainer_spec, "byte_fallback", True),
        lambda m: setattr(m.pieces[10], "type", m.pieces[10].UNUSED),
    ):
        edited = sentencepiece_model_pb2.ModelProto()
        edited.CopyFrom(model)
        change(edited)
        changed.append(tokenization_fingerprint(edited.SerializeToString()))
    assert fingerprint not in changed and len(set(changed)) == 3


def check_legacy_scores(lm, expected, name):
    """`score()` reproduces what 0.1 recorded for the same inputs: the first
    64 columns (`log_probs`) and each next token's entry (`log_probs_rows`,
    the last position's target is not in `token_ids`)."""
    log_probs = to_numpy(
        lm.score(expected["token_ids"], expected["padding_mask"])
    )
    # (The Standard model's `score` returns KerasHub's raw logits, and 0.1
    # recorded those.)
    targets = np.concatenate(
        [
            expected["token_ids"][:, 1:],
            np.zeros_like(expected["token_ids"][:, :1]),
        ],
        axis=1,
    )
    # "Within 1e-6": |a - b| <= 1e-6 (1 + |b|); log-probs near -10 differ in
    # their last bits (float32).
    if "log_probs" in expected:
        np.testing.assert_allclose(
            log_probs[..., :64],
            expected["log_probs"],
            rtol=1e-6,
            atol=1e-6,
            err_msg=name,
        )
    rows = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    mask = expected["padding_mask"][:, 1:]
    np.testing.assert_allclose(
        rows[:, :-1][mask],
        expected["log_probs_rows"][:, :-1][mask],
        rtol=1e-6,
        atol=1e-6,
        err_msg=name,
    )


def test_presets_and_keras_files_saved_by_0_1_load_and_reproduce():
    mhf = np.load(LEGACY / "mhf_expected.npz")
    preset = MultiHashFormerCausalLM.from_preset(
        str(LEGACY / "mhf_tiny_h4b64_preset")
    )
    assert preset.backbone.tokenization_fingerprint is None  # not recorded
    assert preset.scoring_temperature == 2.5
    check_legacy_scores(preset, mhf, "preset")
    saved = keras.saving.load_model(str(LEGACY / "mhf_tiny_h4b64.keras"))
    check_legacy_scores(saved, mhf, ".keras")
    standard = keras_hub.models.CausalLM.from_preset(
        str(LEGACY / "standard_tiny_preset")
    )
    assert isinstance(standard, StandardCausalLM)
    expected = dict(np.load(LEGACY / "standard_expected.npz"))
    expected.update(
        token_ids=mhf["token_ids"], padding_mask=mhf["padding_mask"]
    )
    check_legacy_scores(standard, expected, "standard")


def test_a_task_preset_without_task_json_is_refused(presets, tmp_path):
    preset = tmp_path / "no_task"
    shutil.copytree(presets / "mhf", preset)
    task = json.loads((preset / "task.json").read_text())
    task["config"]["scoring_temperature"] = 1.9
    (preset / "task.json").write_text(json.dumps(task))
    assert (
        MultiHashFormerCausalLM.from_preset(str(preset)).scoring_temperature
        == 1.9
    )
    (preset / "task.json").unlink()
    # Every route: the task class, KerasHub's base class, the preprocessor.
    for load in (
        MultiHashFormerCausalLM.from_preset,
        keras_hub.models.CausalLM.from_preset,
    ):
        with pytest.raises(ValueError, match="has no task.json.*temperature"):
            load(str(preset))
    # An explicit temperature is a choice: it loads with it.
    lm = MultiHashFormerCausalLM.from_preset(
        str(preset), scoring_temperature=1.0
    )
    assert lm.scoring_temperature == 1.0
    # A Standard preset has no task settings to lose; a backbone preset
    # (no preprocessor.json) never had any.
    standard = tmp_path / "standard"
    shutil.copytree(presets / "standard", standard)
    (standard / "task.json").unlink()
    StandardCausalLM.from_preset(str(standard))
    backbone_only = tmp_path / "backbone"
    lm.backbone.save_to_preset(str(backbone_only))
    keras_hub.models.Backbone.from_preset(str(backbone_only))


def test_a_preset_without_its_weights_file_names_it(presets, tmp_path):
    preset = tmp_path / "no_weights"
    shutil.copytree(presets / "mhf", preset)
    (preset / "model.weights.h5").unlink()
    for load in (
        MultiHashFormerCausalLM.from_preset,
        keras_hub.models.CausalLM.from_preset,
    ):
        with pytest.raises(ValueError, match="has no model.weights.h5"):
            load(str(preset))
