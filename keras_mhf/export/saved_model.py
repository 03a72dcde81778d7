"""TF SavedModel export of MultiHashFormer and Standard causal LMs.

Backend-specific module (TensorFlow). Endpoints, every output named:

- `serve(token_ids, padding_mask)` -> `{"log_probs": float32 [b, V]}`:
  log-probabilities of the next token after the last real position
  (`padding_mask` marks real tokens, right-padded), normalised over the real
  vocabulary (for MHF with the model's `scoring_temperature`).
- `score(token_ids, padding_mask)` -> `{"token_log_probs": float32 [b, s]}`:
  `log p(token_ids[:, t] | token_ids[:, :t])` at every real position `t >= 1`
  (0 at position 0 and at padding).
- `generate(token_ids, padding_mask)` -> `{"token_ids", "padding_mask"}`:
  greedy generation that fills every position after the prompt
  (`padding_mask` marks the prompt); the output length is the input length.
- with the model's tokenizer (`include_text_endpoints=True`, the default when
  the model has a preprocessor): `generate_text(prompts, max_new_tokens)` ->
  `{"text", "completion"}` (strings in, strings out: `<s>` is prepended, the
  completion stops at `</s>`), and `score_text(texts)` ->
  `{"log_likelihood", "num_tokens"}` (the summed log-probability of each
  text's tokens after `<s>`). These run SentencePiece in the graph, so
  loading such a SavedModel needs `import tensorflow_text`; without them it
  loads with `tensorflow` alone.

Inputs are validated in the graph: ids must be in `[0, V)`, masks 0/1 and
right-padded (every row with at least one real token), `token_ids` and
`padding_mask` of the same shape with at least one row and one position, and
the string endpoints need at least one string; a violation raises
`InvalidArgumentError` with a message saying which.

The SavedModel is always traced under the TensorFlow backend: from TensorFlow
in this process; from JAX and PyTorch by saving the model (`.keras`) and
re-exporting it under TensorFlow in a subprocess. An existing directory is
refused unless `overwrite=True`.

    model.export("exported")                       # MultiHashFormerCausalLM
    keras_mhf.export.export_causal_lm(standard, "exported_standard")
    keras-mhf export --preset runs/mhf/preset --output exported
"""

import os
import shutil
import subprocess
import sys
import tempfile

import keras
import keras_hub
from keras import ops


def _last_position_log_probs(model, token_ids, padding_mask):
    """float32 `[b, V]` log-probs after the last real token."""
    hidden = model.backbone(
        {"token_ids": token_ids, "padding_mask": padding_mask}
    )
    last = ops.sum(ops.cast(padding_mask, "int32"), axis=-1) - 1
    hidden = ops.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return model.token_log_probs(hidden)


def _token_log_probs(model, token_ids, padding_mask):
    """float32 `[b, s]`: log p of each real token given the ones before it."""
    hidden = model.backbone(
        {"token_ids": token_ids, "padding_mask": padding_mask}
    )
    log_probs = model.token_log_probs(hidden[:, :-1])
    picked = ops.take_along_axis(log_probs, token_ids[:, 1:, None], axis=-1)
    picked = picked[..., 0] * ops.cast(padding_mask[:, 1:], "float32")
    return ops.pad(picked, [[0, 0], [1, 0]])


def _greedy_generate(model, token_ids, padding_mask):
    """Greedy generation whatever the model was compiled with: the sampler is
    swapped only while the endpoint is traced, so the model's compile state
    (optimizer, loss, sampler) stays exactly as it was."""
    sampler = model.sampler
    model.sampler = keras_hub.samplers.GreedySampler()
    try:
        out = model.generate_step(
            {
                "token_ids": token_ids,
                "padding_mask": ops.cast(padding_mask, "bool"),
            },
            stop_token_ids=None,
        )
    finally:
        model.sampler = sampler
    return {
        "token_ids": ops.cast(out["token_ids"], "int32"),
        "padding_mask": ops.cast(out["padding_mask"], "int32"),
    }


def _checked(tf, vocabulary_size, token_ids, padding_mask):
    """Graph-side validation of an id endpoint's inputs; returns the inputs
    with the checks as control dependencies."""
    checks = [
        tf.debugging.assert_equal(
            tf.shape(token_ids),
            tf.shape(padding_mask),
            message="token_ids and padding_mask must have the same shape "
            "[batch, length].",
        ),
        tf.debugging.assert_positive(
            tf.shape(token_ids)[0],
            message="token_ids is an empty batch (shape [0, length]): pass "
            "at least one sequence.",
        ),
        tf.debugging.assert_positive(
            tf.shape(token_ids)[1],
            message="token_ids has no positions (shape [batch, 0]): every "
            "row needs at least one real token, e.g. the start token.",
        ),
        tf.debugging.assert_non_negative(
            token_ids, message="token_ids must be >= 0."
        ),
        tf.debugging.assert_less(
            token_ids,
            tf.constant(vocabulary_size, tf.int32),
            message=f"token_ids must be < vocabulary_size={vocabulary_size}: "
            "tokenize with the model's own tokenizer.",
        ),
        tf.debugging.assert_equal(
            tf.reduce_all((padding_mask == 0) | (padding_mask == 1)),
            True,
            message="padding_mask must hold only 0 and 1.",
        ),
        tf.debugging.assert_equal(
            tf.reduce_all(padding_mask[:, 1:] <= padding_mask[:, :-1]),
            True,
            message="padding_mask must be right-padded (ones, then zeros).",
        ),
        tf.debugging.assert_equal(
            # `[:, :1]`, not `[:, 0]`: a [batch, 0] input must reach the
            # check above instead of failing on the slice.
            tf.reduce_all(padding_mask[:, :1] == 1),
            True,
            message="every row needs at least one real token "
            "(padding_mask[:, 0] must be 1).",
        ),
    ]
    with tf.control_dependencies(checks):
        return tf.identity(token_ids), tf.identity(padding_mask)


def _text_endpoints(tf, model, greedy, scores):
    """`generate_text` and `score_text`: SentencePiece in the graph around
    the id functions `greedy` and `scores`."""
    tokenizer = model.preprocessor.tokenizer
    start = tokenizer.start_token_id
    end = tokenizer.end_token_id
    pad = tokenizer.pad_token_id

    def non_empty(strings, name):
        check = tf.debugging.assert_positive(
            tf.size(strings),
            message=f"{name} is empty: pass at least one string.",
        )
        with tf.control_dependencies([check]):
            return tf.identity(strings)

    def encode(texts):
        ids = tf.cast(tokenizer(texts), tf.int32)
        bos = tf.fill([tf.shape(texts)[0], 1], tf.constant(start, tf.int32))
        return tf.concat([tf.RaggedTensor.from_tensor(bos), ids], axis=1)

    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.string, name="prompts"),
            tf.TensorSpec([], tf.int32, name="max_new_tokens"),
        ]
    )
    def generate_text(prompts, max_new_tokens):
        tf.debugging.assert_positive(
            max_new_tokens, message="max_new_tokens must be >= 1."
        )
        ids = encode(non_empty(prompts, "prompts"))
        lengths = ids.row_lengths()
        total = tf.cast(tf.reduce_max(lengths), tf.int32) + max_new_tokens
        token_ids = ids.to_tensor(default_value=pad)
        token_ids = tf.pad(
            token_ids,
            [[0, 0], [0, total - tf.shape(token_ids)[1]]],
            constant_values=pad,
        )
        mask = tf.sequence_mask(lengths, total, dtype=tf.int32)
        out = greedy(token_ids, mask)["token_ids"]
        # Each row's completion: after its prompt, up to the first </s>,
        # at most max_new_tokens tokens.
        positions = tf.range(total)[None, :]
        begin = tf.cast(lengths, tf.int32)[:, None]
        generated = (positions >= begin) & (positions < begin + max_new_tokens)
        is_end = tf.cast(generated & (out == end), tf.int32)
        before_end = tf.cumsum(is_end, axis=1, exclusive=False) == 0
        keep = generated & before_end
        completion_ids = tf.ragged.boolean_mask(out, keep)
        text_ids = tf.ragged.boolean_mask(out, (positions < begin) | keep)[
            :, 1:
        ]
        return {
            "text": tokenizer.detokenize(text_ids),
            "completion": tokenizer.detokenize(completion_ids),
        }

    @tf.function(
        input_signature=[tf.TensorSpec([None], tf.string, name="texts")]
    )
    def score_text(texts):
        ids = encode(non_empty(texts, "texts"))
        lengths = ids.row_lengths()
        token_ids = ids.to_tensor(default_value=pad)
        mask = tf.sequence_mask(lengths, tf.shape(token_ids)[1], dtype=tf.int32)
        token_log_probs = scores(token_ids, mask)["token_log_probs"]
        return {
            "log_likelihood": tf.reduce_sum(token_log_probs, axis=1),
            "num_tokens": tf.cast(lengths, tf.int32) - 1,
        }

    return generate_text, score_text


def _write_saved_model(model, path, include_text_endpoints, verbose):
    """Traces the endpoints under the TensorFlow backend and writes them."""
    import tensorflow as tf

    vocabulary_size = model.backbone.vocabulary_size
    ids_spec = [
        tf.TensorSpec([None, None], tf.int32, name="token_ids"),
        tf.TensorSpec([None, None], tf.int32, name="padding_mask"),
    ]

    def ids_function(body, key):
        @tf.function(input_signature=ids_spec)
        def endpoint(token_ids, padding_mask):
            token_ids, padding_mask = _checked(
                tf, vocabulary_size, token_ids, padding_mask
            )
            out = body(model, token_ids, padding_mask)
            return out if isinstance(out, dict) else {key: out}

        return endpoint

    archive = keras.export.ExportArchive()
    archive.track(model.backbone)
    serve = ids_function(_last_position_log_probs, "log_probs")
    scores = ids_function(_token_log_probs, "token_log_probs")
    greedy = ids_function(_greedy_generate, "token_ids")
    endpoints = {"serve": serve, "score": scores, "generate": greedy}
    if include_text_endpoints:
        tokenizer = model.preprocessor.tokenizer
        if not tokenizer.built:  # a tokenizer restored from a .keras file
            tokenizer.build(None)
        archive.track(tokenizer)
        generate_text, score_text = _text_endpoints(tf, model, greedy, scores)
        endpoints.update(generate_text=generate_text, score_text=score_text)
    for name, function in endpoints.items():
        function.get_concrete_function()
        archive.add_endpoint(name, function)
    archive.write_out(path, verbose=verbose)
    return path


def export_causal_lm(
    model, path, overwrite=False, include_text_endpoints=None, verbose=False
):
    """Writes the SavedModel described in the module docstring to `path`.

    Args:
        model: a `MultiHashFormerCausalLM` or `StandardCausalLM`.
        path: the SavedModel directory to create.
        overwrite: replace an existing directory (refused otherwise).
        include_text_endpoints: add `generate_text` and `score_text`
            (needs the model's preprocessor; loading then needs
            `tensorflow_text`). Defaults to `True` when the model has a
            preprocessor.
        verbose: print Keras' export summary.

    Returns:
        `path`.
    """
    path = os.path.abspath(str(path))
    if os.path.exists(path):
        if not overwrite:
            raise FileExistsError(
                f"{path} already exists; exporting into it would mix old and "
                "new files. Choose a new path or pass overwrite=True."
            )
    if include_text_endpoints is None:
        include_text_endpoints = model.preprocessor is not None
    if include_text_endpoints and model.preprocessor is None:
        raise ValueError(
            "include_text_endpoints=True needs the model's tokenizer; attach "
            "a preprocessor first."
        )
    backend = keras.config.backend()
    staging = tempfile.mkdtemp(
        prefix=".export_", dir=os.path.dirname(path) or "."
    )
    try:
        target = os.path.join(staging, "saved_model")
        if backend == "tensorflow":
            _write_saved_model(model, target, include_text_endpoints, verbose)
        else:
            _export_via_tensorflow(model, target, include_text_endpoints)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(target, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _export_via_tensorflow(model, path, include_text_endpoints):
    """JAX and PyTorch backends: save the model, re-export it under
    TensorFlow in a subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "model.keras")
        model.save(saved)
        env = dict(os.environ, KERAS_BACKEND="tensorflow")
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "keras_mhf.export.saved_model",
                saved,
                path,
                "text" if include_text_endpoints else "ids",
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(
                "Exporting under the TensorFlow backend failed:\n"
                + done.stderr[-4000:]
            )
    return path


def _main(argv):
    # Run as `python -m keras_mhf.export.saved_model`: importing the package registered
    # the keras_mhf classes before this module ran.
    model = keras.saving.load_model(argv[0])
    _write_saved_model(model, argv[1], argv[2] == "text", verbose=False)


if __name__ == "__main__":
    _main(sys.argv[1:])
