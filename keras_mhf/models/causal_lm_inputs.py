"""Checked inputs of the causal LMs' `generate` and `fit` (MultiHashFormer
and the Standard baseline share this module; neither borrows the other's
methods). `keras_mhf.models.generation` runs `generate` on them.

Prompt lengths:

- `max_length`: the total length, prompt (start token included) and new
  tokens. No prompt may be longer (none is ever cut), and at least one must
  be shorter (something is generated); a prompt that fills it exactly gets
  no new token, as in KerasHub's batches.
- `max_new_tokens`: each prompt gets at most this many new tokens; the total
  length, and so the KV cache, is `longest prompt + max_new_tokens`.
- neither: the preprocessor's `sequence_length` (text) or the width of the
  token-id arrays (no preprocessor), as in KerasHub.
- `truncate="left"`: a text prompt longer than its budget keeps its start
  token and its last tokens instead of being refused.

A prompt that does not fit is refused with a `ValueError` saying what to
pass; nothing is cut silently. For prompts that fit, the packed ids and the
compiled generation function are exactly KerasHub's, so the tokens are the
same.

`fit` inputs are checked at entry (`checked_fit_inputs`) and by the
preprocessor (`check_texts`): one clear error per bad case (no data, a
single string, a non-string entry, a dict with a preprocessor attached)
instead of an error deep inside TensorFlow. Streamed datasets are checked
without reading them (`tf.data` element specs) or on their first batch
(Grain), and token-id data goes through `keras_mhf.utils.token_ids`.
"""

import math
import os

import numpy as np
from keras import ops

from keras_mhf.utils.arguments import check_positive_ints
from keras_mhf.utils.token_ids import check_feature_ids
from keras_mhf.utils.token_ids import check_token_ids
from keras_mhf.utils.token_ids import checked_dataset

TRUNCATE_OPTIONS = (None, "left")

TOKEN_IDS_HINT = (
    "A model with a preprocessor attached takes strings. To use token ids, "
    "detach it (`lm.preprocessor = None`) and pass "
    '`{"token_ids": ..., "padding_mask": ...}` (for `fit`, with `y` and '
    "`sample_weight`); otherwise pass a list of strings."
)


# --- Text ------------------------------------------------------------------


def _describe(value):
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    name = type(value).__name__
    article = "an" if name[0] in "aeiou" else "a"
    return f"{article} {name} ({text})"


def _is_number(value):
    return isinstance(value, (int, float, np.number)) and not isinstance(
        value, bool
    )


def _bad_entry_error(what, index, entry, entries):
    message = (
        f"{what} must be a list of strings (one document or prompt each); "
        f"{what}[{index}] is "
    )
    if entry is None:
        return ValueError(
            message + "None. Drop missing documents or replace them with ''."
        )
    if isinstance(entry, dict):
        return ValueError(message + f"a dict. {TOKEN_IDS_HINT}")
    message += f"{_describe(entry)}."
    if any(isinstance(e, (str, bytes)) for e in entries):
        message += " The entries have mixed types: convert them all to str."
    elif _is_number(entry) or (
        isinstance(entry, (list, tuple, np.ndarray))
        and len(entry)
        and all(_is_number(e) for e in entry)
    ):
        message += f" These look like token ids. {TOKEN_IDS_HINT}"
    return ValueError(message)


def check_texts(x, what="x", allow_single=True):
    """Raises a clear `ValueError` unless `x` is text: a string (if
    `allow_single`), a non-empty list/tuple/array of strings (or bytes), or
    a string tensor. Other tensors and datasets pass unchecked when their
    dtype is unknown here; the check is one `isinstance` per entry (none for
    numpy string arrays), so it costs nothing next to tokenization.

    Args:
        x: the inputs.
        what: how the message names them (`"x"`, `"prompts"`).
        allow_single: whether one bare string is accepted.

    Example:

    ```python
    check_texts(["The cell", "Water"])  # passes
    check_texts(["The cell", None])  # ValueError: x[1] is None ...
    ```
    """
    if isinstance(x, (str, bytes)):
        if allow_single:
            return
        raise ValueError(
            f"{what} is a single string; wrap it in a list: [{x[:30]!r}]."
        )
    if isinstance(x, dict):
        raise ValueError(f"{what} is a dict. {TOKEN_IDS_HINT}")
    if isinstance(x, np.ndarray):
        if x.size == 0:
            raise ValueError(f"{what} is empty: pass at least one string.")
        if x.dtype.kind in "US":
            return
        if x.dtype.kind != "O":
            raise ValueError(
                f"{what} is a numpy array of {x.dtype}, not strings. "
                f"{TOKEN_IDS_HINT}"
            )
        entries = list(x.ravel())
    elif isinstance(x, (list, tuple)):
        entries = x
    else:
        dtype = getattr(getattr(x, "dtype", None), "name", None)
        if dtype is not None and hasattr(x, "shape") and dtype != "string":
            raise ValueError(
                f"{what} is a tensor of {dtype}, not strings. {TOKEN_IDS_HINT}"
            )
        return
    if len(entries) == 0:
        raise ValueError(f"{what} is empty: pass at least one string.")
    for index, entry in enumerate(entries):
        if not isinstance(entry, (str, bytes)):
            raise _bad_entry_error(what, index, entry, entries)


def is_tf_dataset(x):
    return type(x).__module__.startswith("tensorflow") and hasattr(
        x, "element_spec"
    )


def _is_grain_dataset(x):
    return type(x).__module__.startswith("grain")


def check_text_dataset(dataset):
    """Checks that a streamed dataset for a model with a preprocessor yields
    strings: from the `tf.data` element spec (nothing is read), or from the
    first batch of a Grain dataset; other objects pass unchanged."""
    if is_tf_dataset(dataset):
        spec = dataset.element_spec
        x_spec = spec[0] if isinstance(spec, tuple) else spec
        if isinstance(x_spec, dict):
            raise ValueError(f"The dataset yields dicts. {TOKEN_IDS_HINT}")
        dtype = getattr(getattr(x_spec, "dtype", None), "name", None)
        if dtype is not None and dtype != "string":
            raise ValueError(
                f"The dataset yields {dtype} values, not strings. "
                f"{TOKEN_IDS_HINT}"
            )
    elif _is_grain_dataset(dataset):
        for first in dataset:
            check_texts(first[0] if isinstance(first, tuple) else first)
            break


def checked_fit_inputs(causal_lm, x, y=None):
    """Checks `fit`'s data at entry and returns `x` (token-id datasets come
    back wrapped so each batch is checked as it is read).

    With a preprocessor attached, `x` must be text (`check_texts`,
    `check_text_dataset`); without one, token ids are checked against the
    vocabulary (`keras_mhf.utils.token_ids`).

    Args:
        causal_lm: the `MultiHashFormerCausalLM` or `StandardCausalLM`.
        x: `fit`'s `x`.
        y: `fit`'s `y` (token targets when there is no preprocessor).

    Example:

    ```python
    x = checked_fit_inputs(lm, ["The cell is the basic unit of life."])
    ```
    """
    vocabulary_size = causal_lm.backbone.vocabulary_size
    if causal_lm.preprocessor is None:
        if isinstance(x, (list, tuple)) and len(x) == 0:
            raise ValueError("fit got no training data: `x` is empty.")
        check_feature_ids(x, y, vocabulary_size)
        return checked_dataset(x, vocabulary_size)
    if is_tf_dataset(x) or _is_grain_dataset(x):
        check_text_dataset(x)
        return x
    if x is None:
        raise ValueError(
            "fit got no training data (`x=None`): pass a list of strings."
        )
    check_texts(x, "x", allow_single=False)
    return x


# --- Generation lengths ----------------------------------------------------


def check_score_arguments(
    causal_lm, token_ids, padding_mask, scoring_mode, target_ids
):
    """`score`'s arguments, as KerasHub checks them plus the token ids'
    range; returns the padding mask (all ones when `None`)."""
    if scoring_mode not in ("logits", "loss"):
        raise ValueError(
            "Unsupported scoring_mode. Must be one of 'logits' or 'loss'."
        )
    if scoring_mode == "loss" and target_ids is None:
        raise ValueError(
            "Cannot compute loss without targets. Please provide target "
            "token ids via the target_ids parameter."
        )
    vocabulary_size = causal_lm.backbone.vocabulary_size
    check_token_ids(token_ids, vocabulary_size)
    if target_ids is not None:
        check_token_ids(target_ids, vocabulary_size, "Target ids")
    if padding_mask is None:
        padding_mask = ops.ones(ops.shape(token_ids)[:2], dtype="int32")
    return padding_mask


def check_length_arguments(max_length, max_new_tokens, truncate):
    """Raises a clear `ValueError` for impossible `generate` length
    arguments (see `generate`)."""
    if max_length is not None and max_new_tokens is not None:
        raise ValueError(
            "generate: pass either `max_length` (the total length, prompt "
            "included) or `max_new_tokens` (new tokens after the prompt), not "
            f"both; got max_length={max_length}, "
            f"max_new_tokens={max_new_tokens}."
        )
    if max_length is not None:
        check_positive_ints("generate", max_length=max_length)
    if max_new_tokens is not None:
        check_positive_ints("generate", max_new_tokens=max_new_tokens)
    if truncate not in TRUNCATE_OPTIONS:
        raise ValueError(
            "generate: `truncate` must be None (refuse prompts that do not "
            "fit) or 'left' (keep the start token and the prompt's last "
            f"tokens); got {truncate!r}."
        )


def _memory_bytes():
    """The memory generation computes in: the accelerator's, or the
    machine's (`None` where neither is known)."""
    from keras_mhf.utils.device_memory import accelerator_memory_bytes

    memory = accelerator_memory_bytes()
    if memory:
        return int(memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_generation_size(batch, total):
    """Refuses, before anything is computed, a total length whose first
    generation pass cannot fit in memory: seeding the cache attends over
    the whole padded length, so its attention scores alone hold at least
    `batch * total**2` float32 values (one head; the model has more). A
    call that tried (`max_length=100_000` asked a tiny model for 480 GB)
    failed after JAX had donated the model's weights to it, so every later
    call of the model failed too.

    Example:

    ```python
    check_generation_size(batch=1, total=128)  # fits: returns None
    ```
    """
    memory = _memory_bytes()
    needed = 4 * int(batch) * int(total) ** 2
    if memory is None or needed <= memory:
        return
    longest = math.isqrt(memory // (4 * int(batch)))
    raise ValueError(
        f"generate: a total length of {total} tokens for {batch} "
        f"prompt{'s' if batch != 1 else ''} needs at least "
        f"{needed / 1e9:,.0f} GB for the attention scores of the first "
        f"pass, more than the {memory / 1e9:,.0f} GB of memory here; pass a "
        f"smaller max_length or max_new_tokens (a total below {longest:,} "
        "tokens, fewer for a larger model), or fewer prompts at a time."
    )


def _length_error(lengths, total, budget, hint_truncate=True):
    """The `ValueError` for prompts that do not fit in `total` positions:
    one that would be cut (longer than `total`), or a batch in which no
    prompt leaves a position to generate (`None` when they fit)."""
    longest, shortest = max(lengths), min(lengths)
    if longest > total:
        index = lengths.index(longest)
        problem = (
            f"prompt {index} has {longest} tokens (start token included), "
            f"more than {budget} holds, so it would be cut"
        )
    elif shortest >= total:
        problem = (
            f"the prompts fill {budget} (the longest has {longest} tokens, "
            "start token included), so nothing would be generated"
        )
    else:
        return None
    message = (
        f"generate: {problem}. Pass `max_new_tokens=N` to generate N tokens "
        f"after the whole prompt, or `max_length` > {longest}"
    )
    if hint_truncate and total >= 2:
        message += (
            ", or `truncate='left'` to keep the start token and the "
            f"prompt's last {total - 2} tokens"
        )
    return ValueError(message + ".")


def _as_lists(token_ids):
    if hasattr(token_ids, "to_list"):  # tf.RaggedTensor
        token_ids = token_ids.to_list()
    elif not isinstance(token_ids, list):
        token_ids = ops.convert_to_numpy(token_ids).tolist()
    return [[int(t) for t in row] for row in token_ids]


def pack_text_prompts(
    preprocessor, texts, max_length=None, max_new_tokens=None, truncate=None
):
    """Tokenizes and packs a batch of text prompts for generation.

    Args:
        preprocessor: a `CausalLMPreprocessor` (tokenizer and start token).
        texts: a list or array of strings.
        max_length, max_new_tokens, truncate: as in `generate`.

    Returns:
        `(prompt, lengths)`: `{"token_ids", "padding_mask"}` packed to the
        total length exactly as `generate_preprocess` packs them, and each
        prompt's length (start token included) after any truncation.

    Example:

    ```python
    prompt, lengths = pack_text_prompts(
        lm.preprocessor, ["The cell"], max_new_tokens=8
    )
    ```
    """
    if not preprocessor.built:
        preprocessor.build(None)
    packer = preprocessor.packer
    start = len(packer.start_value) if packer.start_value is not None else 0
    token_lists = _as_lists(preprocessor.tokenizer(texts))
    lengths = [len(tokens) + start for tokens in token_lists]
    longest = max(lengths)
    sequence_length = preprocessor.sequence_length
    room = None  # most prompt tokens kept by truncate="left"
    if max_length is not None:
        total, room = max_length, max_length - 1
        budget = f"max_length={max_length} (the total length)"
    elif max_new_tokens is not None and truncate is not None:
        if sequence_length is None:
            raise ValueError(
                "generate: truncate='left' with max_new_tokens needs the "
                "preprocessor's sequence_length (the context to fit in); it "
                "is None. Pass max_length instead."
            )
        room = sequence_length - max_new_tokens
        budget = (
            f"the preprocessor's sequence_length={sequence_length} minus "
            f"max_new_tokens={max_new_tokens}"
        )
    elif max_new_tokens is None:
        if sequence_length is None:
            raise ValueError(
                "generate: the preprocessor has no sequence_length, so the "
                "total length is unknown: pass max_length or max_new_tokens."
            )
        total, room = sequence_length, sequence_length - 1
        budget = (
            f"the preprocessor's sequence_length={sequence_length} (the "
            "default max_length)"
        )
    if room is not None and truncate is None:
        # Prompts up to `total` long fit (one that fills it gets no new
        # token, as in KerasHub's batches), but none is cut, and at least
        # one prompt must leave room to generate.
        error = _length_error(lengths, total, budget)
        if error is not None:
            raise error
    elif room is not None and longest > room:
        keep = room - start
        if keep < 0 or room < 1:
            raise ValueError(
                f"generate: {budget} leaves no room for the prompt's start "
                "token; it must leave at least one prompt token "
                "(max_length >= 2, or max_new_tokens < sequence_length)."
            )
        token_lists = [
            tokens[len(tokens) - keep :] if keep else []
            for tokens in token_lists
        ]
        lengths = [len(tokens) + start for tokens in token_lists]
    if max_new_tokens is not None:
        total = max(lengths) + max_new_tokens
    check_generation_size(len(lengths), total)
    token_ids, padding_mask = packer(
        token_lists, sequence_length=total, add_end_value=False
    )
    return {"token_ids": token_ids, "padding_mask": padding_mask}, lengths


def size_token_id_prompts(prompt, max_length=None, max_new_tokens=None):
    """Checks a token-id prompt `{"token_ids", "padding_mask"}` `[b, s]`
    (right-padded) and resizes it to the total length.

    Without `max_length`/`max_new_tokens` the total length is the arrays'
    width `s`, as in KerasHub; `max_length` sets it, `max_new_tokens` makes it
    `longest prompt + max_new_tokens` (a prompt's length is the position
    after its last unmasked token). Extra columns are padding (id 0,
    masked); only padding columns are ever removed.

    Returns:
        `(prompt, lengths)`: the prompt (the given arrays when the width is
        already right) and each row's length.

    Example:

    ```python
    prompt, lengths = size_token_id_prompts(
        {"token_ids": [[1, 5, 6]], "padding_mask": [[True, True, True]]},
        max_new_tokens=4,
    )  # width 7
    ```
    """
    if (
        not isinstance(prompt, dict)
        or "token_ids" not in prompt
        or "padding_mask" not in prompt
    ):
        got = (
            f"a dict with keys {sorted(prompt)}"
            if isinstance(prompt, dict)
            else _describe(prompt)
        )
        raise ValueError(
            "generate without a preprocessor takes token ids "
            '`{"token_ids": [b, s], "padding_mask": [b, s]}` (right-padded); '
            f"got {got}. To generate from text, attach a preprocessor."
        )
    token_ids = np.asarray(ops.convert_to_numpy(prompt["token_ids"]))
    mask = np.asarray(ops.convert_to_numpy(prompt["padding_mask"])).astype(bool)
    if token_ids.ndim != 2 or mask.shape != token_ids.shape:
        raise ValueError(
            "generate: token_ids and padding_mask must both be [batch, "
            f"length]; got shapes {token_ids.shape} and {mask.shape}."
        )
    if token_ids.shape[0] == 0:
        raise ValueError("generate: the prompt batch is empty.")
    width = token_ids.shape[1]
    lengths = np.where(
        mask.any(axis=1), width - np.argmax(mask[:, ::-1], axis=1), 0
    )
    if (lengths == 0).any():
        row = int(np.argmin(lengths))
        raise ValueError(
            f"generate: prompt {row} has no tokens (its padding_mask is all "
            "False); every prompt needs at least its start token."
        )
    longest = int(lengths.max())
    if max_length is not None:
        total = max_length
        budget = f"max_length={max_length} (the total length)"
    elif max_new_tokens is not None:
        total = longest + max_new_tokens
    else:
        total = width
        budget = (
            f"the prompt's width {width} (the total length without "
            "max_length or max_new_tokens)"
        )
    lengths = [int(n) for n in lengths]
    if max_new_tokens is None:
        error = _length_error(lengths, total, budget, hint_truncate=False)
        if error is not None:
            raise error
    check_generation_size(len(lengths), total)
    if total != width:
        ids = np.zeros((token_ids.shape[0], total), token_ids.dtype)
        new_mask = np.zeros((token_ids.shape[0], total), bool)
        kept = min(width, total)
        ids[:, :kept] = token_ids[:, :kept]
        new_mask[:, :kept] = mask[:, :kept]
        prompt = {
            "token_ids": ops.convert_to_tensor(ids),
            "padding_mask": ops.convert_to_tensor(new_mask),
        }
    return prompt, lengths
