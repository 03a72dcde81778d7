"""`generate` for both causal LMs: KerasHub's `CausalLM.generate` flow
(stop tokens, `strip_prompt`, distribution, output normalisation) on prompts
checked and packed with explicit lengths by `keras_mhf.models.causal_lm_inputs`
(`max_length`, `max_new_tokens`, `truncate`). For prompts that fit, the
packed ids and the compiled generation function are exactly KerasHub's, so
the tokens are the same.
"""

import keras
import numpy as np
from keras import ops

from keras_mhf.models.causal_lm_inputs import check_length_arguments
from keras_mhf.models.causal_lm_inputs import check_texts
from keras_mhf.models.causal_lm_inputs import is_tf_dataset
from keras_mhf.models.causal_lm_inputs import pack_text_prompts
from keras_mhf.models.causal_lm_inputs import size_token_id_prompts
from keras_mhf.utils.keras_private import normalize_generate_outputs


def resolved_stop_token_ids(causal_lm, stop_token_ids):
    """KerasHub's resolution of `stop_token_ids="auto"`."""
    if not (isinstance(stop_token_ids, str) and stop_token_ids == "auto"):
        return stop_token_ids
    if causal_lm.preprocessor is None:
        raise ValueError(
            "A `preprocessor` must be attached to the model if "
            '`stop_token_ids="auto"`. Currently `preprocessor=None`. To '
            "call `generate()` with preprocessing detached, either pass "
            "`stop_token_ids=None` to always generate until `max_length` "
            "or pass a tuple of token ids that should terminate generation "
            "as `stop_token_ids`."
        )
    tokenizer = causal_lm.preprocessor.tokenizer
    stop_token_ids = [tokenizer.end_token_id]
    if hasattr(tokenizer, "end_token2_id"):
        stop_token_ids.append(tokenizer.end_token2_id)
    return stop_token_ids


def distribute(x):
    """Lays the inputs out for the active `keras.distribution` (KerasHub's
    `generate` does the same)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return x

    def distribute(value):
        if value is None:
            return None
        if not ops.is_tensor(value):
            value = ops.convert_to_tensor(value)
        layout = distribution.get_data_layout(value.shape)
        if layout:
            return keras.distribution.distribute_tensor(value, layout)
        return value

    return keras.tree.map_structure(distribute, x)


def _limit_new_tokens(outputs, lengths, max_new_tokens):
    """Masks out what a row generated beyond `max_new_tokens` (shorter rows
    of a batch run as long as the longest)."""
    mask = np.asarray(ops.convert_to_numpy(outputs["padding_mask"])).astype(
        bool
    )
    limit = np.asarray(lengths)[:, None] + max_new_tokens
    keep = np.arange(mask.shape[1])[None, :] < limit
    if keep.all():
        return outputs
    outputs = dict(outputs)
    outputs["padding_mask"] = ops.convert_to_tensor(mask & keep)
    return outputs


def _strip_prompt(x, prompt):
    """KerasHub's `strip_prompt`: rolls each row left by its prompt length
    and keeps only the generated tokens."""
    prompt_mask = prompt["padding_mask"]
    seq_len = ops.shape(prompt_mask)[1]
    shifts = ops.mod(-ops.sum(ops.cast(prompt_mask, "int"), axis=1), seq_len)
    ix = ops.arange(seq_len, dtype="int")
    ix = ops.expand_dims(ix, axis=0) - ops.expand_dims(shifts, axis=1)

    def roll(seq):
        return ops.take_along_axis(seq, ix, axis=1)

    return {
        "padding_mask": ops.logical_xor(
            roll(prompt_mask), roll(x["padding_mask"])
        ),
        "token_ids": roll(x["token_ids"]),
    }


def _pad_to_common_width(outputs):
    """Token-id outputs of several batches, right-padded (masked) to one
    width so they can be concatenated."""
    widths = {int(ops.shape(o["token_ids"])[1]) for o in outputs}
    if len(widths) < 2:
        return outputs
    width = max(widths)
    padded = []
    for o in outputs:
        ids = np.asarray(ops.convert_to_numpy(o["token_ids"]))
        mask = np.asarray(ops.convert_to_numpy(o["padding_mask"])).astype(bool)
        extra = width - ids.shape[1]
        padded.append(
            {
                "token_ids": np.pad(ids, ((0, 0), (0, extra))),
                "padding_mask": np.pad(mask, ((0, 0), (0, extra))),
            }
        )
    return padded


def _prompt_batches(inputs, preprocessor):
    """`(batches of prompts, whether the input was one scalar string)`."""
    if is_tf_dataset(inputs):
        return inputs.as_numpy_iterator(), False
    if preprocessor is None:
        return [inputs], False
    if isinstance(inputs, (str, bytes)):
        return [[inputs]], True
    if hasattr(inputs, "dtype") and tuple(inputs.shape) == ():
        # A scalar string tensor or array.
        return [[np.asarray(inputs).item()]], True
    return [inputs], False


def generate(
    causal_lm,
    inputs,
    max_length=None,
    stop_token_ids="auto",
    strip_prompt=False,
    max_new_tokens=None,
    truncate=None,
):
    """`generate` of both causal LMs: KerasHub's `CausalLM.generate` with
    checked lengths.

    Args:
        causal_lm: a `MultiHashFormerCausalLM` or `StandardCausalLM`.
        inputs: with a preprocessor: a string, a list/array of strings or a
            `tf.data.Dataset` of string batches; without one: token ids
            `{"token_ids", "padding_mask"}` `[b, s]` (right-padded), or a
            dataset of them.
        max_length: int >= 1, the total length (prompt, start token included,
            plus new tokens). A longer prompt is refused (or truncated), and
            so is a batch whose prompts all fill it (nothing to generate); a
            prompt exactly this long, next to shorter ones, gets no new
            token. Default: the preprocessor's `sequence_length`, or the
            token-id arrays' width.
        stop_token_ids: `"auto"` (the tokenizer's end token), `None` or a
            tuple of ids, as in KerasHub.
        strip_prompt: return only the generated part.
        max_new_tokens: int >= 1, instead of `max_length`: each prompt gets
            at most this many new tokens; the total length (and the KV cache)
            is `longest prompt + max_new_tokens`. Each new total length
            compiles the generation function once (JAX, TensorFlow).
        truncate: `None` (default) refuses a prompt that does not fit;
            `"left"` (text prompts only) keeps the start token and the last
            tokens of every prompt longer than `max_length - 1` (with
            `max_length` or by default, `sequence_length`), leaving room for
            one new token;
            `sequence_length - max_new_tokens` with `max_new_tokens`, so
            prompt and new tokens fit in the preprocessor's
            `sequence_length`.

    Returns:
        As KerasHub: strings with a preprocessor, else
        `{"token_ids", "padding_mask"}` numpy arrays.

    Raises:
        ValueError: impossible lengths, a prompt that does not fit (the
            message says what to pass), or inputs of the wrong kind.

    Example:

    ```python
    lm.generate("The cell", max_new_tokens=8)
    lm.generate(long_document, max_new_tokens=32, truncate="left")
    ```
    """
    check_length_arguments(max_length, max_new_tokens, truncate)
    preprocessor = causal_lm.preprocessor
    stop_token_ids = resolved_stop_token_ids(causal_lm, stop_token_ids)
    if preprocessor is None and truncate is not None:
        raise ValueError(
            "generate: truncate='left' applies to text prompts (it keeps the "
            "start token and the last tokens); token-id prompts are used as "
            "given: cut them yourself, or attach a preprocessor."
        )
    generate_function = causal_lm.make_generate_function()
    batches, input_is_scalar = _prompt_batches(inputs, preprocessor)

    outputs = []
    for batch in batches:
        if preprocessor is None:
            prompt, lengths = size_token_id_prompts(
                batch, max_length, max_new_tokens
            )
        else:
            check_texts(batch, "prompts", allow_single=False)
            prompt, lengths = pack_text_prompts(
                preprocessor, batch, max_length, max_new_tokens, truncate
            )
        prompt = distribute(prompt)
        output = generate_function(prompt, stop_token_ids=stop_token_ids)
        if max_new_tokens is not None:
            output = _limit_new_tokens(output, lengths, max_new_tokens)
        if strip_prompt:
            output = _strip_prompt(output, prompt)
        if preprocessor is not None:
            output = preprocessor.generate_postprocess(output)
        outputs.append(output)
    if not outputs:
        raise ValueError("generate: the dataset yielded no prompts.")
    if preprocessor is None:
        outputs = _pad_to_common_width(outputs)
    return normalize_generate_outputs(causal_lm, outputs, input_is_scalar)
