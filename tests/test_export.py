"""SavedModel export from the current backend, reloaded by a fresh
TensorFlow-only process (no keras, no keras_mhf imported there)."""

import os
import subprocess
import sys

import keras
import keras_hub
import numpy as np
import pytest
from keras import ops

from keras_mhf.models import standard_causal_lm

RELOAD = """
import sys, numpy as np, tensorflow as tf
assert "keras_mhf" not in sys.modules
model = tf.saved_model.load(sys.argv[1])
out = {}
for name in ("a", "b"):
    d = np.load(sys.argv[2] + f"_{name}.npz")
    out[f"serve_{name}"] = model.serve(
        token_ids=d["ids"], padding_mask=d["mask"]).numpy()
    g = model.generate(token_ids=d["gen_ids"], padding_mask=d["gen_mask"])
    out[f"gen_{name}"] = g["token_ids"].numpy()
np.savez(sys.argv[3], **out)
"""


def batches(vocabulary_size):
    rng = np.random.default_rng(0)
    result = {}
    for name, (batch, length) in (("a", (2, 7)), ("b", (3, 11))):
        ids = rng.integers(3, vocabulary_size, size=(batch, length)).astype(
            "int32"
        )
        ids[:, 0] = 1
        mask = np.ones_like(ids)
        mask[0, length - 2 :] = 0  # right padding in one row
        ids[mask == 0] = 0
        gen_mask = np.zeros_like(ids)
        gen_mask[:, :3] = 1
        result[name] = dict(
            ids=ids, mask=mask, gen_ids=ids * gen_mask, gen_mask=gen_mask
        )
    return result


def keras_reference(model, data):
    lengths = data["mask"].sum(1) - 1
    scores = np.asarray(
        ops.convert_to_numpy(model.score(data["ids"], data["mask"])), "float32"
    )
    scores = scores - scores.max(-1, keepdims=True)
    log_probs = scores - np.log(np.exp(scores).sum(-1, keepdims=True))
    serve = log_probs[np.arange(len(lengths)), lengths]
    preprocessor = model.preprocessor
    model.preprocessor = None
    model.compile(sampler="greedy")
    gen = model.generate(
        {
            "token_ids": data["gen_ids"],
            "padding_mask": data["gen_mask"].astype(bool),
        },
        stop_token_ids=None,
    )
    model.preprocessor = preprocessor
    return serve, np.asarray(ops.convert_to_numpy(gen["token_ids"]))


@pytest.mark.parametrize("kind", ["mhf", "standard"])
def test_export_and_reload_in_plain_tensorflow(
    kind, tiny_lm, small_tokenizer, tmp_path
):
    if kind == "standard":
        keras.utils.set_random_seed(1)
        model = standard_causal_lm(small_tokenizer, "tiny", sequence_length=16)
        from keras_mhf.export import export_causal_lm

        export_causal_lm(model, str(tmp_path / "saved"))
    else:
        model = tiny_lm
        model.export(str(tmp_path / "saved"))
    data = batches(small_tokenizer.vocabulary_size())
    prefix = str(tmp_path / "batch")
    for name, d in data.items():
        np.savez(f"{prefix}_{name}.npz", **d)
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            RELOAD,
            str(tmp_path / "saved"),
            prefix,
            str(tmp_path / "out.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    for name, d in data.items():
        serve, gen = keras_reference(model, d)
        assert out[f"serve_{name}"].shape == (
            len(d["ids"]),
            small_tokenizer.vocabulary_size(),
        )
        assert out[f"serve_{name}"].dtype == np.float32
        np.testing.assert_allclose(out[f"serve_{name}"], serve, atol=1e-5)
        np.testing.assert_array_equal(out[f"gen_{name}"], gen)


def test_export_leaves_the_compile_state_alone(tiny_lm, corpus, tmp_path):
    """Exporting does not recompile: optimizer (and its state), loss and
    sampler are the ones the user set."""
    optimizer = keras.optimizers.AdamW(1e-3)
    sampler = keras_hub.samplers.TopPSampler(p=0.9)
    tiny_lm.compile(optimizer=optimizer, sampler=sampler)
    tiny_lm.fit(corpus[:4], batch_size=2, epochs=1, verbose=0)
    loss = tiny_lm.loss
    before = [np.array(ops.convert_to_numpy(v)) for v in optimizer.variables]
    tiny_lm.export(str(tmp_path / "saved"))
    assert tiny_lm.optimizer is optimizer and tiny_lm.loss is loss
    assert tiny_lm.sampler is sampler
    after = [np.array(ops.convert_to_numpy(v)) for v in optimizer.variables]
    assert len(before) == len(after) and int(before[0]) > 0  # iterations
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
