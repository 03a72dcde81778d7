"""Locality-sensitive hash heads: the authors' LSH ablation (paper Sec. 6,
"MMH3 vs. LSH"), bit for bit.

With `num_lsh = L > 0`, heads `0..L-1` of a signature are LSH ids of the
token's character trigrams instead of MurmurHash3 buckets, so that tokens
spelled alike tend to share buckets. The authors' procedure
(`initialize_hash_map` in their `modeling_qwen3.py`):

1. Projections, from torch's CPU generator: `P1 = randn(16000, L, 512)`
   seeded 3407, and `P2 = normalize(randn(512 * L, L, B - 1), dim=-1)` seeded
   3408 (unit rows over the bucket axis).
2. Features: the `Counter` of the token string's character trigrams (the
   token itself when it is shorter than 3 characters), in first-seen order.
3. Stage 1, per head `j`: each trigram goes to row
   `murmur3_x64_128(trigram, seed=j) % 16000` of `P1[:, j, :]`; the
   count-weighted sum of those rows (a float32 `[1, n] @ [n, 512]` product)
   is binarised to `+512**-0.5` where `>= 0`, else `-512**-0.5`. The `L`
   results, concatenated, are `x` (length `512 * L`).
4. Stage 2, per head `j`: `id_j = argmax(x @ P2[:, j, :]) + 1`, so ids are
   `1..B-1`; the pad token gets 0.

Because the projections come from torch's generator, this module needs
PyTorch (imported here, lazily, and nowhere else in `keras_mhf`'s signature
code); tables without LSH heads never import it.

Stage 1 runs the authors' float32 product token by token. Stage 2 multiplies
all tokens at once; wherever the top two scores of a token are so close that
two float32 summation orders could disagree on the argmax (a rigorous bound,
about 1-2% of tokens), that token is recomputed with the authors' exact
one-token product, so the ids equal theirs (same torch, same machine).
"""

import collections

import mmh3
import numpy as np

TRIGRAM_ROWS = 16000
FEATURE_DIM = 512
FIRST_SEED = 3407
SECOND_SEED = 3408
# Tokens per batched stage-2 product (about 64 MB of float32 scores at
# B = 16384).
_CHUNK = 1024
_SCALE = np.float32(FEATURE_DIM**-0.5)

_cache = {}


def _torch():
    try:
        import torch
    except ImportError as error:
        raise ImportError(
            "LSH heads (num_lsh > 0) need PyTorch: their random projections "
            "come from torch's CPU generator, as in the authors' code. "
            "Install it with `pip install torch==2.13.0` (the CPU wheel; "
            "`pip install keras-mhf[torch]`), or use num_lsh=0."
        ) from error
    return torch


def projections(num_lsh, num_buckets):
    """The authors' two LSH projections, as float32 torch tensors.

    Args:
        num_lsh: int `L >= 1`, the number of LSH heads.
        num_buckets: int `B >= 2` (bucket 0 included).

    Returns:
        `(p1, p2)`: `p1` `[16000, L, 512]` (seed 3407) and `p2`
        `[512 * L, L, B - 1]` (seed 3408), normalised over its last axis.
        The last result is cached.

    Example:

    ```python
    p1, p2 = projections(1, 64)
    p1.shape, p2.shape  # (16000, 1, 512), (512, 1, 63)
    ```
    """
    key = (int(num_lsh), int(num_buckets))
    if key not in _cache:
        torch = _torch()
        first = torch.Generator()
        first.manual_seed(FIRST_SEED)
        p1 = torch.randn((TRIGRAM_ROWS, key[0], FEATURE_DIM), generator=first)
        second = torch.Generator()
        second.manual_seed(SECOND_SEED)
        p2 = torch.randn(
            (FEATURE_DIM * key[0], key[0], key[1] - 1), generator=second
        )
        p2 = torch.nn.functional.normalize(p2, dim=-1)
        _cache.clear()  # one configuration at a time (P2 is L*L*B*2 KiB)
        _cache[key] = (p1, p2)
    return _cache[key]


def trigram_counts(token):
    """The token's character-trigram counts, in first-seen order; a token
    shorter than 3 characters is its own single feature.

    Example:

    ```python
    trigram_counts("▁abab")  # Counter({'▁ab': 1, 'aba': 1, 'bab': 1})
    ```
    """
    if len(token) < 3:
        return collections.Counter([token])
    return collections.Counter(token[i : i + 3] for i in range(len(token) - 2))


def lsh_ids(tokens, num_lsh, num_buckets, pad_token_id=None):
    """LSH ids `[len(tokens), num_lsh]` (int64, `1..B-1`; 0 for the pad).

    Args:
        tokens: list of token strings, in id order.
        num_lsh: int `L >= 1`.
        num_buckets: int `B >= 2`.
        pad_token_id: index in `tokens` of the pad token (all-zero ids), or
            `None`.

    Returns:
        numpy int64 array `[len(tokens), L]`.

    Example:

    ```python
    lsh_ids(["<pad>", "▁the", "▁then"], 1, 64, pad_token_id=0)  # [3, 1]
    ```
    """
    torch = _torch()
    num_lsh, num_buckets = int(num_lsh), int(num_buckets)
    p1, p2 = projections(num_lsh, num_buckets)
    ids = np.zeros((len(tokens), num_lsh), "int64")
    real = [v for v in range(len(tokens)) if v != pad_token_id]
    if not real:
        return ids
    with torch.no_grad():
        signs = _first_stage(torch, [tokens[v] for v in real], p1, num_lsh)
        x = torch.from_numpy(np.where(signs, _SCALE, -_SCALE))
        for j in range(num_lsh):
            ids[real, j] = _second_stage(torch, x, p2[:, j, :])
    return ids


def _first_stage(torch, tokens, p1, num_lsh):
    """Bool `[n, 512 * L]`: where each token's stage-1 output is `>= 0`."""
    hash128 = mmh3.hash128
    heads = [p1[:, j, :] for j in range(num_lsh)]
    signs = np.zeros((len(tokens), FEATURE_DIM * num_lsh), bool)
    for k, token in enumerate(tokens):
        counts = trigram_counts(token)
        freq = torch.tensor([list(counts.values())], dtype=p1.dtype)
        for j, head in enumerate(heads):
            rows = [
                hash128(t, seed=j, x64arch=True, signed=False) % TRIGRAM_ROWS
                for t in counts
            ]
            out = (freq @ head[rows])[0]
            signs[k, j * FEATURE_DIM : (j + 1) * FEATURE_DIM] = (
                out >= 0
            ).numpy()
    return signs


def _second_stage(torch, x, head):
    """`argmax(x @ head) + 1` per row of `x` `[n, K]` (`head` `[K, B-1]`)."""
    k = x.shape[1]
    unit = 2.0**-24
    gamma = k * unit / (1 - k * unit)
    # |float32 dot - exact| <= gamma_K * sum_k |x_k| |P_kb|, whatever the
    # summation order (blocked, pairwise, FMA). If the batched top score
    # leads every other by more than 4x the largest such bound, every
    # float32 implementation picks the same argmax; otherwise recompute
    # the row exactly as the authors do (a one-row product).
    column_bound = (
        gamma * float(_SCALE) * head.abs().to(torch.float64).sum(0).max().item()
    )
    margin = 4.0 * column_bound * 2.0  # x2: slack for the bound itself
    out = np.zeros(x.shape[0], "int64")
    for start in range(0, x.shape[0], _CHUNK):
        block = x[start : start + _CHUNK]
        scores = block @ head
        top = torch.topk(scores, 2, dim=-1) if scores.shape[1] > 1 else None
        best = scores.argmax(dim=-1)
        if top is None:
            close = torch.zeros(block.shape[0], dtype=torch.bool)
        else:
            gap = top.values[:, 0] - top.values[:, 1]
            close = gap <= margin
        for row in torch.nonzero(close).flatten().tolist():
            best[row] = (block[row : row + 1] @ head).argmax(dim=-1)[0]
        out[start : start + block.shape[0]] = best.numpy() + 1
    return out
