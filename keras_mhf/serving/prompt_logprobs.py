"""Log-probabilities of given tokens under a causal LM's scoring rule, in
the shape of the OpenAI completions API's `logprobs` (the legacy format).

Each token's log-probability is the one evaluation uses
(`keras_mhf.evaluation.next_token_scores`: the compiled `NextTokenScorer`;
MultiHashFormer: `log_softmax_V(s(w) / scoring_temperature)`, calibrated
when the preset has a scoring temperature, the paper's rule otherwise), so
lm-eval reading them through the server gets `keras-mhf evaluate`'s numbers.
A token that is the scorer's argmax is its own top entry, with the same
value, so lm-eval's greedy check agrees with evaluation's.
"""

import numpy as np
from keras import ops

from keras_mhf.evaluation.scoring import pad_batch
from keras_mhf.models.next_token_scorer import NextTokenScorer

# Positions whose `[V]` log-probs are formed at once for the top entries.
TOP_CHUNK = 128


def _top_entries(causal_lm, ids, start, k):
    """The `k` best `(token id, log-prob)` after each prefix `ids[:p]`,
    `p` in `[start, len(ids))`: `(top ids [n, k], top values [n, k])`."""
    token_ids = np.asarray([ids], "int32")
    hidden = causal_lm.backbone(
        {"token_ids": token_ids, "padding_mask": np.ones_like(token_ids)}
    )
    top_ids, top_values = [], []
    for begin in range(start - 1, len(ids) - 1, TOP_CHUNK):
        end = min(begin + TOP_CHUNK, len(ids) - 1)
        log_probs = causal_lm.token_log_probs(hidden[:, begin:end])
        values, chosen = ops.top_k(ops.cast(log_probs[0], "float32"), k)
        top_ids.append(np.asarray(ops.convert_to_numpy(chosen)))
        top_values.append(np.asarray(ops.convert_to_numpy(values)))
    return np.concatenate(top_ids), np.concatenate(top_values)


def token_logprobs(causal_lm, rows, starts, top):
    """Per row: `log p(ids[p] | ids[:p])` for `p` in `[start, len(ids))`
    and, with `top` >= 1, the `top` best entries at each of them.

    Args:
        causal_lm: the served causal LM.
        rows: token-id lists, each starting with `<s>`.
        starts: per row, the first position to score (>= 1).
        top: how many top entries per position (0: none).

    Returns:
        per row `(values [n] float list, tops: per position a list of
        `(token id, value)` best first, or `None` when `top` is 0)`.

    Example:

    ```python
    values, _ = token_logprobs(lm, [[1, 40, 41]], [1], 0)[0]
    ```
    """
    scorer = NextTokenScorer.for_model(causal_lm)
    ids, mask = pad_batch(rows)
    picked, is_argmax, best, argmax = scorer(ids, mask, with_argmax=True)
    results = []
    for row, (tokens, start) in enumerate(zip(rows, starts)):
        positions = np.arange(start - 1, len(tokens) - 1)
        values = [float(v) for v in picked[row, positions]]
        if not top or not len(positions):
            results.append((values, None if not top else []))
            continue
        if top > 1:
            top_ids, top_values = _top_entries(causal_lm, tokens, start, top)
        tops = []
        for i, p in enumerate(positions):
            token, value = int(tokens[p + 1]), values[i]
            # The scorer's argmax heads the list: the token itself, with
            # its own value, or the argmax with the scorer's best value
            # (above the token's, so lm-eval's greedy check agrees).
            if is_argmax[row, p]:
                head = (token, value)
            else:
                high = max(best[row, p], np.nextafter(value, np.inf))
                head = (int(argmax[row, p]), float(high))
            entries = [head]
            if top > 1:
                entries += [
                    (int(t), float(v))
                    for t, v in zip(top_ids[i], top_values[i])
                    if int(t) != head[0]
                ]
            tops.append(entries[:top])
        results.append((values, tops))
    return results


def openai_logprobs(served, ids, values, tops, offset, first=True):
    """The legacy `logprobs` object of `ids` (their log-probs `values`, a
    `None` for a first token with nothing before it; `tops` per position,
    or `None` for no `top_logprobs`), with text offsets from `offset`;
    `first`: the ids begin a text."""
    tokenizer = served.tokenizer
    texts = tokenizer.token_texts(ids, first=first)
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    top_logprobs = None
    if tops is not None:
        top_logprobs = []
        for entries in tops:
            if entries is None:
                top_logprobs.append(None)
                continue
            top_logprobs.append(
                {
                    _entry_text(tokenizer, token, texts): value
                    for token, value in entries
                }
            )
    return {
        "tokens": texts,
        "token_logprobs": values,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _entry_text(tokenizer, token, texts):
    if token is None:
        return "<unknown>"
    return (
        tokenizer.token_texts([token], first=False)[0]
        or (tokenizer.vocabulary[token])
    )
