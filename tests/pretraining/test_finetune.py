"""`keras_mhf.pretraining.finetune` and `keras-mhf finetune`: LoRA
fine-tuning of a preset on raw text with pre-training's engine (held-out
split, checkpoints that resume exactly, calibrated perplexity before and
after). Runs under JAX only (the engine does not depend on the backend;
tests/test_lora.py covers LoRA itself on all three)."""

import json
import os
import shutil

import keras
import numpy as np
import pytest

from tests.conftest import small_proto_bytes
from tests.pretraining_helpers import checkpoint_variables
from tests.pretraining_helpers import compile_once_fixture  # noqa: F401
from tests.pretraining_helpers import stop_after_chunks
from tests.pretraining_helpers import write_documents

pytestmark = pytest.mark.skipif(
    keras.config.backend() != "jax",
    reason="the fine-tuning engine is backend-independent; tested on JAX",
)

RUN = dict(
    sequence_length=16,
    batch_size=4,
    steps=4,
    checkpoint_every=2,
    warmup_steps=1,
    learning_rate=1e-2,
    validation_blocks=16,
    validation_fraction=0.2,
    workers=1,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import MultiHashFormerTokenizer

    root = tmp_path_factory.mktemp("finetune")
    keras.utils.set_random_seed(0)
    lm = MultiHashFormerCausalLM.from_tokenizer(
        MultiHashFormerTokenizer(small_proto_bytes()),
        "tiny_h3b64",
        sequence_length=16,
    )
    preset = str(root / "base")
    lm.save_to_preset(preset)
    documents = write_documents(root / "docs.jsonl", count=120)
    return root, preset, documents


def recipe_main(argv, capsys):
    from keras_mhf.cli import finetune as recipe

    capsys.readouterr()
    try:
        recipe.main([str(a) for a in argv])
        status = 0
    except SystemExit as exit:
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


def flags(settings):
    return [
        part
        for name, value in settings.items()
        for part in ("--" + name.replace("_", "-"), str(value))
    ]


def last_checkpoint(output):
    return checkpoint_variables(
        os.path.join(output, "checkpoints", "step_000004")
    )


def test_recipe_and_exact_resume(setup, capsys):
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models.lora import lora_layers
    from keras_mhf.pretraining import finetune

    root, preset, documents = setup
    whole = root / "whole"
    status, out, err = recipe_main(
        ["--preset", preset, "--data", documents, "--output", whole]
        + ["--lora-rank", 2, "--quiet"]
        + flags(RUN),
        capsys,
    )
    assert status == 0, err[-3000:]
    summary = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert summary["finished"] and summary["lora_rank"] == 2
    assert summary["parameters"] == 2 * 2 * 2 * (32 * 2 + 2 * 32 + 2 * 16) or (
        summary["parameters"] < 2000
    )
    for results in (summary["before"], summary):
        assert results["calibration"]["applied"]
        assert np.isfinite(results["validation"]["perplexity"])
        assert results["validation_windows"]["reported"] == [8, 16]
    assert "Held-out perplexity before -> after fine-tuning" in out
    assert os.path.exists(whole / "adapter.lora.h5")
    # The preset holds the merged model: it loads without LoRA.
    merged = MultiHashFormerCausalLM.from_preset(summary["preset"])
    assert lora_layers(merged) == []
    assert merged.scoring_temperature == pytest.approx(
        summary["scoring_temperature"]
    )
    # A run stopped after its first checkpoint and rerun ends the same (on
    # the corpus the recipe prepared: the same token streams, prepared once).
    resumed, prepared = str(root / "resumed"), str(whole / "data")
    settings = dict(RUN, verbose=0)
    with stop_after_chunks(1):
        _, first = finetune(preset, prepared, resumed, lora_rank=2, **settings)
    assert first["status"] == "incomplete" and first["step"] == 2
    lm, second = finetune(preset, prepared, resumed, lora_rank=2, **settings)
    assert second["finished"]
    assert second["before"] == summary["before"]
    expected, found = last_checkpoint(str(whole)), last_checkpoint(resumed)
    # The checkpoint holds the base kernels and the adapters as they are.
    assert expected.keys() == found.keys()
    for name in expected:
        np.testing.assert_array_equal(found[name], expected[name])
    # Only the adapters trained: the base weights are the preset's.
    base = MultiHashFormerCausalLM.from_preset(preset)
    tuned = {v.path: v for v in lm.weights}
    for variable in base.weights:
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(tuned[variable.path].value),
            keras.ops.convert_to_numpy(variable.value),
        )
    # Another rank on the same output is refused (run.json).
    status, _, err = recipe_main(
        ["--preset", preset, "--data", documents, "--output", whole]
        + ["--lora-rank", 4, "--quiet"]
        + flags(RUN),
        capsys,
    )
    assert status == 2 and "lora_rank" in err


def test_bad_presets_and_ranks_are_refused(setup, tmp_path, capsys):
    from keras_mhf.pretraining import RunConfigError
    from keras_mhf.pretraining import finetune

    root, preset, documents = setup
    output = tmp_path / "out"
    with pytest.raises(RunConfigError, match="--lora-rank must be an integer"):
        finetune(preset, documents, str(output), lora_rank=-1)
    with pytest.raises(RunConfigError, match="has no config.json"):
        finetune(str(tmp_path), documents, str(output))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({"class_name": "GPT2Backbone"})
    )
    with pytest.raises(RunConfigError, match="holds a GPT2Backbone model"):
        finetune(str(other), documents, str(output))
    # A quantized preset (its config's dtype policies; see test_lora.py for
    # a quantized model itself).
    shutil.copytree(preset, tmp_path / "int8")
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    config["config"]["dtype"] = {
        "class_name": "DTypePolicyMap",
        "config": {
            "policy_map": {
                "hash_encoder": {
                    "class_name": "QuantizedDTypePolicy",
                    "config": {"mode": "int8"},
                }
            }
        },
    }
    (tmp_path / "int8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunConfigError, match="quantized model"):
        finetune(str(tmp_path / "int8"), documents, str(output), **RUN)
    assert not output.exists()
    # Without a rank every weight of the preset trains (full fine-tuning).
    from keras_mhf.pretraining import RunConfig
    from keras_mhf.pretraining.presets import load_initial_model

    config = RunConfig(documents, str(output), initial_preset=preset)
    config.validate()
    assert config.model == "mhf" and config.tokenizer.endswith("vocabulary.spm")
    lm = load_initial_model(config)
    trainable = {w.path for w in lm.trainable_weights}
    assert "hash_encoder/embeddings_0" in trainable
    assert "transformer_layer_0/self_attention/query/kernel" in trainable
    assert not any("lora" in w.path for w in lm.weights)
    with pytest.raises(RunConfigError, match="needs a preset"):
        RunConfig(documents, str(output), lora_rank=4).validate()
    # 0, as on the command line, is every weight.
    assert RunConfig(documents, str(output), lora_rank=0).lora_rank is None
    status, _, err = recipe_main(
        ["--preset", preset, "--data", documents, "--output", output]
        + ["--lora-rank", -1],
        capsys,
    )
    assert status == 2 and "--lora-rank must be" in err


def test_a_refused_run_leaves_nothing_and_bad_lines_can_be_skipped(
    setup, tmp_path
):
    import gzip

    from keras_mhf.data import CorpusWarning
    from keras_mhf.pretraining import RunConfigError
    from keras_mhf.pretraining import finetune

    _, preset, documents = setup
    lines = open(documents, encoding="utf-8").read().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        "\n".join(lines[:50] + ['{"text": null}'] + lines[50:]) + "\n"
    )
    output = tmp_path / "out"
    with pytest.raises(
        RunConfigError, match=r"bad.jsonl:51: 'text' is null.*--on-error skip"
    ):
        finetune(preset, str(bad), str(output), **RUN)
    # Nothing of the refused run is left (data/, run.json, the tokenizer):
    # the corrected command starts afresh instead of being refused.
    assert not output.exists()
    with pytest.warns(CorpusWarning, match="bad.jsonl:51"):
        with stop_after_chunks(1):
            _, summary = finetune(
                preset, str(bad), str(output), on_error="skip", **RUN
            )
    assert summary["step"] == 2
    # A .jsonl.gz cut short is named, and skipped from where it breaks.
    cut = tmp_path / "cut.jsonl.gz"
    data = gzip.compress(("\n".join(lines) + "\n").encode())
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        RunConfigError,
        match=r"cut.jsonl.gz:\d+: the compressed file is cut short",
    ):
        finetune(preset, str(cut), str(tmp_path / "out_gz"), **RUN)
    assert not (tmp_path / "out_gz").exists()
