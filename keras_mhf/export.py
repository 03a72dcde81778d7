"""TF SavedModel export of MultiHashFormer and Standard causal LMs.

Backend-specific module. The SavedModel has two endpoints, both on token ids
(no tokenizer ops inside, so loading needs only `tensorflow`):

- `serve(token_ids, padding_mask)` -> float32 `[b, V]`: log-probabilities of
  the next token after the last real position (`padding_mask` marks real
  tokens, right-padded), normalised over the real vocabulary.
- `generate(token_ids, padding_mask)` -> `{"token_ids", "padding_mask"}`:
  greedy generation that fills every position after the prompt
  (`padding_mask` marks the prompt); the output length is the input length.

Export works from the TensorFlow and JAX backends directly (JAX through
`jax2tf` with a shared symbolic `(batch, seq)` shape), and from PyTorch by
saving the model and re-exporting it under the TensorFlow backend in a
subprocess.

    model.export("exported")                       # MultiHashFormerCausalLM
    keras_mhf.export.export_causal_lm(standard, "exported_standard")
    python tools/export.py --preset runs/mhf/preset --output exported

    import tensorflow as tf
    reloaded = tf.saved_model.load("exported")
    reloaded.serve(token_ids=ids, padding_mask=mask)
"""

import os
import subprocess
import sys
import tempfile

import keras
import keras_hub
from keras import ops


def _next_token_log_probs(model, token_ids, padding_mask):
    """float32 `[b, V]` log-probs after the last real token."""
    hidden = model.backbone(
        {"token_ids": token_ids, "padding_mask": padding_mask}
    )
    last = ops.sum(ops.cast(padding_mask, "int32"), axis=-1) - 1
    last = ops.maximum(last, 0)
    hidden = ops.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    if hasattr(model, "token_log_probs"):  # MultiHashFormerCausalLM
        return model.token_log_probs(hidden)
    logits = model.backbone.token_embedding(hidden, reverse=True)
    return ops.log_softmax(ops.cast(logits, "float32"), axis=-1)


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


def export_causal_lm(model, path, verbose=False):
    """Writes the SavedModel described in the module docstring to `path`."""
    backend = keras.config.backend()
    if backend == "torch":
        return _export_via_tensorflow(model, path)
    if backend not in ("tensorflow", "jax"):
        raise ValueError(f"Export is not supported on the {backend!r} backend.")
    import tensorflow as tf

    spec = {
        "token_ids": tf.TensorSpec([None, None], tf.int32, name="token_ids"),
        "padding_mask": tf.TensorSpec(
            [None, None], tf.int32, name="padding_mask"
        ),
    }
    kwargs = {}
    if backend == "jax":
        # One symbol for both inputs: they share the batch and length.
        kwargs["jax2tf_kwargs"] = {
            "polymorphic_shapes": ["(batch, seq)", "(batch, seq)"],
            "native_serialization": True,
        }
    archive = keras.export.ExportArchive()
    # Token ids in and out: only the layers that hold weights are tracked, so
    # the tokenizer's TF ops stay out and loading needs no tensorflow_text.
    archive.track(model.backbone)
    if hasattr(model, "hash_decoder"):
        archive.track(model.hash_decoder)
    archive.add_endpoint(
        "serve",
        lambda token_ids, padding_mask: _next_token_log_probs(
            model, token_ids, padding_mask
        ),
        input_signature=[spec["token_ids"], spec["padding_mask"]],
        **kwargs,
    )
    archive.add_endpoint(
        "generate",
        lambda token_ids, padding_mask: _greedy_generate(
            model, token_ids, padding_mask
        ),
        input_signature=[spec["token_ids"], spec["padding_mask"]],
        **kwargs,
    )
    archive.write_out(path, verbose=verbose)
    return path


def _export_via_tensorflow(model, path):
    """PyTorch backend: save the model, re-export it under TensorFlow."""
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "model.keras")
        model.save(saved)
        env = dict(os.environ, KERAS_BACKEND="tensorflow")
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "keras_mhf.export",
                saved,
                os.path.abspath(path),
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
    # Run as `python -m keras_mhf.export`: importing the package registered
    # the keras_mhf classes before this module ran.
    model = keras.saving.load_model(argv[0])
    export_causal_lm(model, argv[1])


if __name__ == "__main__":
    _main(sys.argv[1:])
