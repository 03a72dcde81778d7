"""SavedModel export from the current backend, reloaded by fresh processes
that import only TensorFlow (and tensorflow_text for the string endpoints):
no keras, no keras_mhf there."""

import json
import os
import subprocess
import sys

import keras
import keras_hub
import numpy as np
import pytest
from keras import ops

from keras_mhf.export import export_causal_lm
from keras_mhf.models import standard_causal_lm

RELOAD_IDS = """
import sys, numpy as np, tensorflow as tf
prefix = sys.argv[1]
for saved, out_path in zip(sys.argv[2::2], sys.argv[3::2]):
    model = tf.saved_model.load(saved)
    out = {}
    for name in ("a", "b"):
        d = np.load(prefix + f"_{name}.npz")
        out[f"serve_{name}"] = model.serve(
            token_ids=d["ids"], padding_mask=d["mask"]
        )["log_probs"].numpy()
        out[f"score_{name}"] = model.score(
            token_ids=d["ids"], padding_mask=d["mask"]
        )["token_log_probs"].numpy()
        g = model.generate(token_ids=d["gen_ids"], padding_mask=d["gen_mask"])
        out[f"gen_{name}"] = g["token_ids"].numpy()
    np.savez(out_path, **out)
assert "keras_mhf" not in sys.modules
assert "tensorflow_text" not in sys.modules
"""

RELOAD_TEXT = """
import json, sys, tensorflow as tf, tensorflow_text  # noqa: F401
model = tf.saved_model.load(sys.argv[1])
assert "keras_mhf" not in sys.modules
prompts = json.loads(sys.argv[2])
generated = model.generate_text(
    prompts=tf.constant(prompts), max_new_tokens=tf.constant(6)
)
scored = model.score_text(texts=tf.constant(prompts))
empty = {}
for name, call in (
    ("score_text", lambda: model.score_text(texts=tf.constant([], tf.string))),
    ("generate_text", lambda: model.generate_text(
        prompts=tf.constant([], tf.string), max_new_tokens=tf.constant(2))),
):
    try:
        call()
        empty[name] = "accepted"
    except tf.errors.InvalidArgumentError as error:
        empty[name] = str(error)
print(json.dumps({
    "empty": empty,
    "text": [t.decode() for t in generated["text"].numpy()],
    "completion": [t.decode() for t in generated["completion"].numpy()],
    "log_likelihood": scored["log_likelihood"].numpy().tolist(),
    "num_tokens": scored["num_tokens"].numpy().tolist(),
}))
"""


def batches(vocabulary_size):
    rng = np.random.default_rng(0)
    result = {}
    for name, (batch, length) in (("a", (2, 7)), ("b", (3, 11))):
        ids = rng.integers(3, vocabulary_size, size=(batch, length))
        ids = ids.astype("int32")
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


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x), "float32")


def log_softmax(scores):
    scores = scores - scores.max(-1, keepdims=True)
    return scores - np.log(np.exp(scores).sum(-1, keepdims=True))


def keras_reference(model, data):
    """What the endpoints must return, from the Keras model."""
    log_probs = log_softmax(to_numpy(model.score(data["ids"], data["mask"])))
    lengths = data["mask"].sum(1) - 1
    serve = log_probs[np.arange(len(lengths)), lengths]
    picked = np.take_along_axis(
        log_probs[:, :-1], data["ids"][:, 1:, None], -1
    )[..., 0]
    score = np.pad(picked * data["mask"][:, 1:], [[0, 0], [1, 0]])
    preprocessor, sampler = model.preprocessor, model.sampler
    model.preprocessor = None
    model.compile(sampler="greedy")
    gen = model.generate(
        {
            "token_ids": data["gen_ids"],
            "padding_mask": data["gen_mask"].astype(bool),
        },
        stop_token_ids=None,
    )
    model.preprocessor, model.sampler = preprocessor, sampler
    return serve, score, np.asarray(ops.convert_to_numpy(gen["token_ids"]))


def run_in_plain_tensorflow(script, *args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(cwd),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def check_id_endpoints(exports, vocabulary_size, tmp_path):
    """Loads every `(model, SavedModel path)` of `exports` in one process
    that imports TensorFlow alone, and checks the id endpoints' outputs
    against each Keras model."""
    data = batches(vocabulary_size)
    prefix = str(tmp_path / "batch")
    for name, d in data.items():
        np.savez(f"{prefix}_{name}.npz", **d)
    outputs = [str(tmp_path / f"out_{i}.npz") for i in range(len(exports))]
    run_in_plain_tensorflow(
        RELOAD_IDS,
        prefix,
        *[a for (_, saved), out in zip(exports, outputs) for a in (saved, out)],
        cwd=tmp_path,
    )
    for (model, _), path in zip(exports, outputs):
        out = np.load(path)
        for name, d in data.items():
            serve, score, gen = keras_reference(model, d)
            shape = (len(d["ids"]), vocabulary_size)
            assert out[f"serve_{name}"].shape == shape
            assert out[f"serve_{name}"].dtype == np.float32
            np.testing.assert_allclose(out[f"serve_{name}"], serve, atol=1e-5)
            np.testing.assert_allclose(out[f"score_{name}"], score, atol=1e-5)
            np.testing.assert_array_equal(out[f"gen_{name}"], gen)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, small_proto, corpus):
    """The module's one export, read by its tests: `(model, path, state)`.
    A tiny MultiHashFormer with a scoring temperature (0.5, not the paper's
    1.0: the endpoints must serve it), compiled with AdamW and a top-p
    sampler and fitted one epoch, is exported with its text endpoints over
    an existing directory: without `overwrite=True` the export is refused
    and the directory kept; with it, the directory is replaced. `state`
    holds the compile state and optimizer variables before the export."""
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import MultiHashFormerTokenizer

    keras.utils.set_random_seed(0)
    model = MultiHashFormerCausalLM.from_tokenizer(
        MultiHashFormerTokenizer(small_proto),
        "tiny_h3b64",
        sequence_length=16,
        scoring_temperature=0.5,
    )
    optimizer = keras.optimizers.AdamW(1e-3)
    sampler = keras_hub.samplers.TopPSampler(p=0.9)
    model.compile(optimizer=optimizer, sampler=sampler)
    model.fit(corpus[:4], batch_size=2, epochs=1, verbose=0)
    state = dict(
        optimizer=optimizer,
        sampler=sampler,
        loss=model.loss,
        variables=[
            np.array(ops.convert_to_numpy(v)) for v in optimizer.variables
        ],
    )
    target = tmp_path_factory.mktemp("export") / "saved"
    target.mkdir()
    (target / "old_file.txt").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        model.export(str(target))
    assert (target / "old_file.txt").exists()
    saved = model.export(str(target), overwrite=True)
    assert not (target / "old_file.txt").exists()
    return model, saved, state


def test_mhf_export_text_endpoints(exported, tmp_path):
    """The compile state is left alone by the export, and the string
    endpoints (SentencePiece in the graph) match `generate` and `score` in
    a process with only TensorFlow and tensorflow_text."""
    tiny_lm, saved, state = exported
    # Exporting does not recompile: optimizer state, loss, sampler unchanged.
    optimizer = state["optimizer"]
    assert tiny_lm.optimizer is optimizer and tiny_lm.loss is state["loss"]
    assert tiny_lm.sampler is state["sampler"]
    before = state["variables"]
    after = [np.array(ops.convert_to_numpy(v)) for v in optimizer.variables]
    assert len(before) == len(after) and int(before[0]) > 0  # iterations
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)

    tokenizer = tiny_lm.preprocessor.tokenizer
    prompts = ["The cell", "Water boils at one"]
    out = json.loads(
        run_in_plain_tensorflow(
            RELOAD_TEXT, saved, json.dumps(prompts), cwd=tmp_path
        ).splitlines()[-1]
    )
    # Empty string batches: a clear error, not a failing slice.
    assert "texts is empty" in out["empty"]["score_text"], out["empty"]
    assert "prompts is empty" in out["empty"]["generate_text"], out["empty"]
    sampler = tiny_lm.sampler
    tiny_lm.compile(optimizer=optimizer, sampler="greedy")
    for i, prompt in enumerate(prompts):
        ids = [tokenizer.start_token_id] + [
            int(t) for t in to_numpy(tokenizer(prompt)).astype(int)
        ]
        expected = tiny_lm.generate(prompt, max_length=len(ids) + 6)
        assert out["text"][i] == expected, (out["text"][i], expected)
        assert out["text"][i].startswith(prompt)
        assert out["num_tokens"][i] == len(ids) - 1
        log_probs = log_softmax(to_numpy(tiny_lm.score(np.array([ids]))))[0]
        expected_ll = sum(log_probs[t - 1, ids[t]] for t in range(1, len(ids)))
        np.testing.assert_allclose(
            out["log_likelihood"][i], expected_ll, atol=1e-4
        )
    tiny_lm.compile(optimizer=optimizer, sampler=sampler)


def test_ids_only_exports_load_with_tensorflow_alone(
    exported, small_tokenizer, tmp_path
):
    keras.utils.set_random_seed(1)
    standard = standard_causal_lm(small_tokenizer, "tiny", sequence_length=16)
    exports = [
        (
            model,
            export_causal_lm(
                model, str(tmp_path / name), include_text_endpoints=False
            ),
        )
        for name, model in (("mhf", exported[0]), ("standard", standard))
    ]
    check_id_endpoints(exports, small_tokenizer.vocabulary_size(), tmp_path)


def test_bad_inputs_are_refused_in_the_graph(exported):
    import tensorflow as tf
    import tensorflow_text  # noqa: F401 (the text endpoints' ops)

    tiny_lm, saved, _ = exported
    model = tf.saved_model.load(saved)
    vocabulary_size = tiny_lm.backbone.vocabulary_size
    ids = np.array([[1, 5, 6, 0]], "int32")
    mask = np.array([[1, 1, 1, 0]], "int32")
    cases = [
        (np.array([[1, 5, vocabulary_size, 0]]), mask, "token_ids must be <"),
        (np.array([[1, -3, 6, 0]]), mask, "token_ids must be >= 0"),
        (ids, np.array([[1, 2, 1, 0]]), "only 0 and 1"),
        (ids, np.array([[0, 1, 1, 1]]), "right-padded"),
        (ids, np.zeros((1, 4)), "at least one real token"),
        (np.tile(ids, (2, 1)), mask, "same shape"),
        (np.zeros((1, 0)), np.zeros((1, 0)), r"no positions \(shape"),
        (np.zeros((0, 4)), np.zeros((0, 4)), "empty batch"),
    ]
    for bad_ids, bad_mask, message in cases:
        for endpoint in (model.serve, model.score, model.generate):
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                endpoint(
                    token_ids=tf.constant(bad_ids, tf.int32),
                    padding_mask=tf.constant(bad_mask, tf.int32),
                )
    # A start token then padding, in every row: valid, and answered.
    start_only = dict(
        token_ids=tf.constant([[1, 0], [1, 0]], tf.int32),
        padding_mask=tf.constant([[1, 0], [1, 0]], tf.int32),
    )
    log_probs = model.serve(**start_only)["log_probs"].numpy()
    assert log_probs.shape == (2, vocabulary_size)
    assert np.isfinite(log_probs).all()
    np.testing.assert_array_equal(
        model.score(**start_only)["token_log_probs"].numpy(), 0.0
    )
    generated = model.generate(**start_only)
    assert generated["padding_mask"].numpy().tolist() == [[1, 1], [1, 1]]
