"""MultiHashFormer inference (paper Sec. 3.4, "Inference Phase"): from the
cascade's per-head bucket logits to token scores. Scoring, generation,
evaluation, calibration and export all go through this module.

The score of a token is additive over heads, `s(w) = sum_i log p_i(h_i(w))`
(`token_scores`, the one place the heads are summed, always in head order so
that every path gives the same floats), and the distribution is
`log_softmax_V(s(w) / tau)` (`token_log_probs`). `vocabulary_statistics`
scans the vocabulary in chunks with an online log-sum-exp, so scoring and
evaluation never form `[..., V]`. Generation (greedy, top-k through the
inverted index, other samplers) is `multi_hash_former_decoding`.
"""

import keras
import numpy as np
from keras import ops

from keras_mhf.utils.keras_utils import dense_layout

# Scores held at a time by the vocabulary scan (4 MB of float32;
# `python -m benchmarks.benchmark --inference scoring` measures it).
SCAN_SCORES = 1 << 20
# On PyTorch, scans of at least this many chunks run each chunk compiled
# (`keras_mhf.utils.torch_compile`); shorter ones stay eager, where a first
# compilation would cost more than it saves.
TORCH_COMPILE_CHUNKS = 32


# --- Token scores ------------------------------------------------------------


def head_log_probs(bucket_logits):
    """Bucket logits `[..., H, B]` -> per-head log-probs `[..., H, B]`
    (float32; a log-softmax over `B` leaves log-probs unchanged)."""
    return ops.log_softmax(ops.cast(bucket_logits, "float32"), axis=-1)


def heads(causal_lm, hidden_states):
    """A task's final hidden states `[..., d]` -> `(per-head log-probs
    [..., H, B], its signature table [V, H])`: the cascade's bucket logits
    (Sec. 3.3) through `head_log_probs`, and the rows they score."""
    log_probs = head_log_probs(causal_lm.hash_decoder(hidden_states))
    return log_probs, causal_lm.backbone.signature_lookup.signatures


def sum_over_heads(num_hashes, head_score):
    """`head_score(0) + head_score(1) + ... + head_score(H - 1)`, in this
    order: the one sum over heads of `s(w)` (Sec. 3.4)."""
    total = None
    for i in range(num_hashes):
        part = head_score(i)
        total = part if total is None else total + part
    return total


def token_scores(log_probs, signatures, per_position=False):
    """Raw scores `s(w) = sum_i log p_i(h_i(w))` of a set of rows.

    Args:
        log_probs: float32 `[..., H, B]` per-head log-probs.
        signatures: int `[n, H]`, the same `n` rows for every position
            (e.g. the whole table: `[..., V]` scores), or, with
            `per_position`, `[..., n, H]` rows of each position.
        per_position: see `signatures`.

    Returns:
        float32 `[..., n]`.
    """
    signatures = ops.cast(signatures, "int32")
    num_hashes = ops.shape(signatures)[-1]

    def head_score(i):
        if per_position:
            return ops.take_along_axis(
                log_probs[..., i, :], signatures[..., i], axis=-1
            )
        return ops.take(log_probs[..., i, :], signatures[:, i], axis=-1)

    return sum_over_heads(num_hashes, head_score)


def token_log_probs(log_probs, signatures, temperature=1.0):
    """`log_softmax_V(s(w) / temperature)` over the rows of the whole table
    `signatures [V, H]`: `[..., V]` float32."""
    scores = token_scores(log_probs, signatures)
    if temperature != 1.0:  # 1.0: exactly the paper's rule
        scores = scores / temperature
    return ops.log_softmax(scores, axis=-1)


def _scan_chunk(positions):
    """Tokens per chunk of `vocabulary_statistics`: about `SCAN_SCORES`
    scores at a time, a power of two between 256 and 65536."""
    if positions is None:
        return 4096
    fit = int(np.log2(max(1, SCAN_SCORES // positions)))
    return int(2 ** max(8, min(16, fit)))


def vocabulary_statistics(
    log_probs, signatures, targets, temperature=1.0, with_argmax=True
):
    """Per-position `(target log-prob, top log-prob, argmax id)` under
    `log_softmax_V(s(w) / temperature)`, without forming `[..., V]`.

    The vocabulary is scanned in chunks that stay in cache, with an online
    log-sum-exp; each head's log-probs are laid out `[B, n]` so that gathering
    a chunk of tokens reads whole contiguous rows. The same numbers as
    `token_log_probs` (to float32 rounding of the normaliser); argmax ties go
    to the lowest token id. `logit_statistics` does the same from the
    cascade's per-head logits.

    Args:
        log_probs: float32 `[..., H, B]` per-head log-probs.
        signatures: int `[V, H]`, the signature table.
        targets: int `[...]` token ids.
        temperature: the scoring temperature `tau`, a number or a scalar
            tensor.
        with_argmax: if `False`, the argmax is not tracked (returned as -1).

    Returns:
        `(target, best, best_id)`, each `[...]`.
    """
    num_hashes, num_buckets = log_probs.shape[-2:]
    log_probs = ops.reshape(log_probs, (-1, num_hashes, num_buckets))
    heads = [log_probs[:, i, :] for i in range(num_hashes)]
    return _scan(heads, False, signatures, targets, temperature, with_argmax)


def logit_statistics(
    head_logits, signatures, targets, temperature=1.0, with_argmax=True
):
    """`vocabulary_statistics` from the cascade's bucket logits, a list of
    the `H` heads' `[n, B]` (`CascadeHashDecoder.head_logits`) for flat
    `targets [n]`: each head's log-softmax (Sec. 3.3) is taken with its
    `[B, n]` layout, so the heads are never stacked into `[n, H, B]`."""
    return _scan(
        head_logits, True, signatures, targets, temperature, with_argmax
    )


def next_token_statistics(
    causal_lm, hidden_states, targets, with_argmax=True, temperature=None
):
    """`(log p(target), top log-prob, argmax id)` per position of a
    `MultiHashFormerCausalLM`'s `hidden_states` `[..., d]` and `targets`
    `[...]`, never forming `[..., V]` (`logit_statistics`), at
    `temperature` (a scalar tensor lets a compiled scorer serve every
    temperature; default: the model's `scoring_temperature`).

    Example:

    ```python
    target, best, best_id = next_token_statistics(lm, hidden, targets)
    ```
    """
    if temperature is None:
        temperature = causal_lm.scoring_temperature
    decoder = causal_lm.hash_decoder
    states = ops.reshape(hidden_states, (-1, decoder.hidden_dim))
    target, best, best_id = logit_statistics(
        decoder.head_logits(states),
        causal_lm.backbone.signature_lookup.signatures,
        ops.reshape(targets, (-1,)),
        temperature,
        with_argmax=with_argmax,
    )
    shape = ops.shape(targets)
    return tuple(ops.reshape(x, shape) for x in (target, best, best_id))


def _scan(heads, normalise, signatures, targets, temperature, with_argmax):
    """The vocabulary scan behind `vocabulary_statistics` and
    `logit_statistics`: `heads` are the `H` heads' `[n, B]` log-probs, or
    logits when `normalise`."""
    batch_shape = ops.shape(targets)
    vocabulary_size, num_hashes = signatures.shape
    targets = ops.reshape(ops.cast(targets, "int32"), (-1,))
    positions = ops.shape(heads[0])[0]
    static = heads[0].shape[0]
    chunk = _scan_chunk(static if isinstance(static, int) else None)
    chunks = -(-vocabulary_size // chunk)
    padded = chunks * chunk != vocabulary_size
    table = ops.pad(
        ops.cast(signatures, "int32"),
        [[0, chunks * chunk - vocabulary_size], [0, 0]],
    )
    # A number 1.0: exactly the paper's rule, no division. Otherwise a
    # tensor, so that a compiled chunk (PyTorch) or scorer serves every
    # temperature (dividing by a tensor 1.0 is exact too).
    if isinstance(temperature, (int, float)):
        temperature = float(temperature)
        scale = None if temperature == 1.0 else temperature
    else:
        scale = temperature
    if scale is not None:
        scale = ops.cast(scale, "float32")
    layout, update = _head_columns, _chunk_update
    if keras.config.backend() == "torch" and chunks >= TORCH_COMPILE_CHUNKS:
        from keras_mhf.utils.torch_compile import compiled

        layout, update = compiled(_head_columns), compiled(_chunk_update)
    columns = layout(heads, normalise)
    limit = vocabulary_size if padded else None

    def body(c, carry):
        start = c * chunk
        rows = ops.slice(table, [start, 0], [chunk, num_hashes])
        first = ops.convert_to_tensor(start, "int32")
        return update(columns, rows, first, carry, scale, limit, with_argmax)

    init = (
        ops.full((positions,), float("-inf"), "float32"),
        ops.zeros((positions,), "float32"),
        ops.full((positions,), float("-inf"), "float32"),
        ops.full((positions,), -1, "int32"),
    )
    running_max, total, best, best_id = ops.fori_loop(0, chunks, body, init)
    normaliser = running_max + ops.log(total)
    # The targets' scores from the same columns, in head order.
    target_rows = ops.take(table, targets, axis=0)
    target = sum_over_heads(
        num_hashes,
        lambda i: ops.take_along_axis(
            columns[i], target_rows[None, :, i], axis=0
        )[0],
    )
    if scale is not None:
        target = target / scale
    return (
        ops.reshape(target - normaliser, batch_shape),
        ops.reshape(best - normaliser, batch_shape),
        ops.reshape(best_id, batch_shape),
    )


def _head_columns(heads, normalise):
    """The `H` heads' `[n, B]` log-probs (logits when `normalise`: their
    `head_log_probs` is taken here) -> each laid out `[B, n]`, so that
    gathering a chunk of tokens reads whole contiguous rows."""
    if normalise:
        heads = [head_log_probs(head) for head in heads]
    return [dense_layout(ops.transpose(head)) for head in heads]


def _chunk_update(columns, rows, first, carry, temperature, limit, argmax):
    """One chunk of `vocabulary_statistics`: the scores of the tokens
    `first, first + 1, ...` whose signatures are `rows [chunk, H]` (divided
    by `temperature` unless it is `None`), folded into the running `(max,
    sum of exp, best, best id)` per position (an online log-sum-exp). Rows
    from `limit` on are padding and never count; with `argmax` off the best
    id is left as it is."""
    running_max, total, best, best_id = carry
    chunk, num_hashes = rows.shape
    scores = sum_over_heads(
        num_hashes, lambda i: ops.take(columns[i], rows[:, i], axis=0)
    )  # [chunk, n]
    if temperature is not None:
        scores = scores / temperature
    if limit is not None:
        ids = first + ops.arange(chunk, dtype="int32")
        scores = ops.where((ids < limit)[:, None], scores, float("-inf"))
    chunk_max = ops.amax(scores, axis=0)
    new_max = ops.maximum(running_max, chunk_max)
    total = total * ops.exp(running_max - new_max) + ops.sum(
        ops.exp(scores - new_max[None, :]), axis=0
    )
    if argmax:
        chunk_id = ops.cast(ops.argmax(scores, axis=0), "int32") + first
        best_id = ops.where(chunk_max > best, chunk_id, best_id)
    best = ops.maximum(best, chunk_max)
    return new_max, total, best, best_id


# --- The trunk, and the trunk with a KV cache --------------------------------


def trunk(backbone, token_ids, padding_mask, layer_intercept_fn=None):
    """The backbone's forward pass (embedding, blocks, final norm) with
    KerasHub's `layer_intercept_fn(x, i)` on the embeddings (`i = -1`) and
    on each block's output: final hidden states `[b, s, d]`."""
    if layer_intercept_fn is None:

        def layer_intercept_fn(x, unused_i):
            return x

    x = layer_intercept_fn(backbone.embed(token_ids), -1)
    for i, block in enumerate(backbone.transformer_layers):
        x = layer_intercept_fn(block(x, decoder_padding_mask=padding_mask), i)
    return backbone.layer_norm(x)
