"""The Hugging Face export's modeling file on the `transformers` releases it
supports (`MIN_TRANSFORMERS` on): its code paths for the older releases
are run here on the pinned one, whose classes are made to look like the
older ones (the KV cache named `past_key_values` as the trunk's argument
and as the output field; RoPE as `rope_theta` / `rope_scaling`); older
releases are refused with their version. The real releases are checked by
`python -m benchmarks.check_transformers_versions` (results in
benchmarks/results/transformers_versions.json)."""

import builtins
import dataclasses
import importlib.util
import itertools
import json
import os
import sys

import keras
import numpy as np
import pytest

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import MultiHashFormerTokenizer

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

MODELING = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    "keras_mhf",
    "export",
    "transformers",
    "modeling_multi_hash_former.py",
)
IDS = np.array([[1, 5, 17, 33, 60, 2, 90, 41], [1, 7, 8, 9, 10, 11, 12, 13]])
_names = itertools.count()


def load_modeling():
    """A fresh copy of the modeling module (its constants can then be
    changed without touching other tests' copy)."""
    spec = importlib.util.spec_from_file_location(
        f"modeling_multi_hash_former_{next(_names)}", MODELING
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def export_dir(small_proto, tmp_path_factory):
    """A tiny export with linear RoPE scaling (4.x configures it as
    `rope_scaling`, 5.x as `rope_parameters`)."""
    keras.utils.set_random_seed(0)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        MultiHashFormerTokenizer(small_proto),
        "tiny_h3b64",
        sequence_length=16,
        num_layers=1,
        rope_scaling_factor=2.0,
    )
    path = tmp_path_factory.mktemp("versions") / "hf"
    lm.export_to_transformers(str(path))
    return path, np.asarray(keras.ops.convert_to_numpy(lm.score(IDS)))


def test_an_older_release_is_refused_naming_both_versions(monkeypatch):
    module = load_modeling()
    minimum = module.MIN_TRANSFORMERS
    assert minimum == "4.51.1"  # Qwen3 arrived in 4.51.0 (see the file)
    for supported in (minimum, "4.57.6", "5.3.0", transformers.__version__):
        module.check_transformers_version(supported)
    with pytest.raises(ImportError) as error:
        module.check_transformers_version("4.51.0")
    assert "needs transformers >= 4.51.1" in str(error.value)
    assert "transformers 4.51.0 is installed" in str(error.value)
    # At import, before any Qwen3 import can fail with a less clear error
    # (the module that `import transformers` gives now: a lazy module that
    # can have been replaced since this file's import).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.0")
    with pytest.raises(ImportError, match=r"4\.46\.0 is installed"):
        load_modeling()


def test_the_pinned_release_is_detected_as_such():
    module = load_modeling()
    assert module.TRUNK_CACHE_ARGUMENT == "cache"
    assert module.OUTPUT_CACHE_FIELD == "cache"
    assert module.HAS_ROPE_PARAMETERS


def test_legacy_rope_fields():
    module = load_modeling()
    assert module.legacy_rope_fields(
        {"rope_type": "default", "rope_theta": 1e6}
    ) == {"rope_theta": 1e6}
    assert module.legacy_rope_fields(
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    ) == {
        "rope_theta": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }


# The 4.x output classes, as plain dataclasses: the pinned `ModelOutput`
# renames a `past_key_values` field to `cache`.
@dataclasses.dataclass
class LegacyTrunkOutput:
    """A 4.x `BaseModelOutputWithPast`."""

    last_hidden_state: torch.Tensor = None
    past_key_values: object = None
    hidden_states: tuple = None
    attentions: tuple = None


@dataclasses.dataclass
class LegacyCausalLMOutput:
    """A 4.x `CausalLMOutputWithPast`."""

    loss: torch.Tensor = None
    logits: torch.Tensor = None
    past_key_values: object = None
    hidden_states: tuple = None
    attentions: tuple = None


def as_release_4(module, model, monkeypatch):
    """Makes the pinned classes look like 4.x's: the trunk takes its cache
    as `past_key_values` (the pinned trunk still accepts that name) and
    returns it in a `past_key_values` field; RoPE fields are the legacy
    ones."""
    monkeypatch.setattr(module, "TRUNK_CACHE_ARGUMENT", "past_key_values")
    monkeypatch.setattr(module, "OUTPUT_CACHE_FIELD", "past_key_values")
    monkeypatch.setattr(module, "CausalLMOutputWithPast", LegacyCausalLMOutput)
    monkeypatch.setattr(module, "HAS_ROPE_PARAMETERS", False)
    trunk_forward = model.model.forward
    received = []

    def legacy_trunk(*args, **kwargs):
        assert "cache" not in kwargs
        received.append(kwargs.get("past_key_values"))
        out = trunk_forward(*args, **kwargs)
        return LegacyTrunkOutput(
            last_hidden_state=out.last_hidden_state,
            past_key_values=out.cache,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )

    monkeypatch.setattr(model.model, "forward", legacy_trunk)
    return received


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_release_4_code_paths_give_the_same_numbers(export_dir, monkeypatch):
    """Logits, loss and a decoding step with the cache passed back as
    `past_key_values` (as 4.x `generate` does) equal the Keras log-probs."""
    path, expected = export_dir
    module = load_modeling()
    monkeypatch.setattr(module, "HAS_ROPE_PARAMETERS", False)
    config = module.MultiHashFormerConfig.from_pretrained(str(path))
    assert config.rope_parameters == {
        "rope_type": "linear",
        "factor": 2.0,
        "rope_theta": 1e6,
    }
    with open(path / "config.json") as f:
        assert json.load(f)["rope_parameters"] == config.rope_parameters
    model = module.MultiHashFormerForCausalLM.from_pretrained(
        str(path), config=config
    )
    received = as_release_4(module, model, monkeypatch)
    ids = torch.tensor(IDS, dtype=torch.long)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        assert isinstance(out, LegacyCausalLMOutput)
        np.testing.assert_allclose(
            out.logits.numpy(), expected, atol=1e-5, rtol=0
        )
        assert out.past_key_values.get_seq_length() == IDS.shape[1]
        loss = model(ids, labels=ids).loss
        prefix = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], past_key_values=prefix.past_key_values)
    expected_loss = -np.mean(
        np.take_along_axis(expected[:, :-1], IDS[:, 1:, None], -1)
    )
    np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5)
    assert received[-1] is prefix.past_key_values
    np.testing.assert_allclose(
        step.logits.numpy()[:, -1], expected[:, -1], atol=1e-5, rtol=0
    )


def test_the_pinned_release_generates_with_the_cache(export_dir):
    path, expected = export_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), trust_remote_code=True
    )
    lengths = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True,
    )
    with torch.no_grad():
        greedy = model.generate(
            torch.tensor(IDS[:1, :3]), max_new_tokens=4, do_sample=False
        )
    hook.remove()
    assert lengths == [3, 1, 1, 1]  # one token a step after the prompt
    ids = IDS[:1, :3].tolist()[0]
    for _ in range(4):
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits
        ids.append(int(logits[0, -1].argmax()))
    assert greedy[0].tolist() == ids


def test_the_tokenizer_loads_without_remote_code(
    export_dir, small_proto, monkeypatch
):
    """`PreTrainedTokenizerFast` loads the export's tokenizer on every
    release without asking for remote code (`AutoTokenizer` does too on
    4.x; 5.x reads `config.json` first, which names the model's code):
    `tokenizer_config.json` names a stock class and no code of ours."""
    path, _ = export_dir

    def no_prompt(message=""):
        raise AssertionError(f"asked on stdin: {message}")

    monkeypatch.setattr(builtins, "input", no_prompt)
    with open(path / "tokenizer_config.json") as f:
        config = json.load(f)
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "auto_map" not in config
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    ours = MultiHashFormerTokenizer(small_proto)
    text = "The cell is the basic unit of life."
    expected = [1] + [int(i) for i in keras.ops.convert_to_numpy(ours(text))]
    assert hf(text)["input_ids"] == expected
