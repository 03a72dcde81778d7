"""Token streams -> fixed-length blocks for `model.fit` (numpy only).

Documents are tokenized, each prefixed with the BOS token, concatenated and
cut into fixed-length blocks, as the authors' pre-training pipeline does (no
attention reset between documents). This in-memory path suits small corpora;
`prepare_data` + `window_dataset` stream large ones from disk.

Example:

```python
blocks = pack_documents(
    read_documents("corpus.txt"), sp.encode, sp.bos_id(), 128
)
x, y, sample_weight = blocks_to_features(blocks)
```
"""

import numpy as np


def pack_documents(
    documents, tokenize, bos_id, sequence_length, max_tokens=None
):
    """Tokenizes, prefixes BOS, concatenates and cuts blocks of
    `sequence_length + 1` tokens (the remainder is dropped).

    Args:
        documents: iterable of document strings.
        tokenize: callable, text -> token ids (e.g. `sp.encode`).
        bos_id: id put before every document.
        sequence_length: model sequence length `L`; blocks hold `L + 1`.
        max_tokens: stop after this many tokens (`None`: all).

    Returns:
        int32 array `[num_blocks, sequence_length + 1]`.

    Example:

    >>> pack_documents(
    ...     ["ab", "c"], lambda t: [ord(c) for c in t], 1, 2
    ... ).tolist()
    [[1, 97, 98]]
    """
    stream = []
    total = 0
    for text in documents:
        ids = [bos_id] + list(tokenize(text))
        stream.append(np.asarray(ids, "int32"))
        total += len(ids)
        if max_tokens and total >= max_tokens:
            break
    if not stream:
        raise ValueError("The corpus holds no text.")
    tokens = np.concatenate(stream)
    if max_tokens:
        tokens = tokens[:max_tokens]
    block = sequence_length + 1
    count = len(tokens) // block
    if count == 0:
        raise ValueError(
            f"The corpus has {len(tokens)} tokens, fewer than one block of "
            f"{block}; use more text or a shorter sequence_length."
        )
    return tokens[: count * block].reshape(count, block)


def blocks_to_features(blocks):
    """`[n, L+1]` blocks (or windows) -> `(x, y, sample_weight)` for `fit`
    without a preprocessor: `x = {"token_ids": blocks[:, :-1],
    "padding_mask": ones}`, `y = blocks[:, 1:]`, float32 ones (contiguous
    arrays).

    Example:

    >>> x, y, sample_weight = blocks_to_features(np.array([[1, 5, 6]]))
    >>> x["token_ids"].tolist(), y.tolist(), sample_weight.tolist()
    ([[1, 5]], [[5, 6]], [[1.0, 1.0]])
    """
    token_ids = np.ascontiguousarray(blocks[:, :-1])
    x = {"token_ids": token_ids, "padding_mask": np.ones_like(token_ids)}
    y = np.ascontiguousarray(blocks[:, 1:])
    return x, y, np.ones(y.shape, "float32")
