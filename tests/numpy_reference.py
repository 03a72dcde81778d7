"""An independent numpy implementation of the paper's equations (Sec. 3),
written from the text, for checking the Keras layers and converted models."""

import numpy as np


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=axis, keepdims=True))


def hash_encoder(signatures, tables, w1, b1, w2, b2, ws, bs):
    """Sec. 3.1. tables [H, B, d]; w1 [d, g]; w2 [g, 1]; ws [d, d] (in, out)."""
    num_hashes = tables.shape[0]
    u = np.stack([tables[i][signatures[..., i]] for i in range(num_hashes)], -2)
    a = (silu(u @ w1 + b1) @ w2 + b2)[..., 0]
    alpha = softmax(a, axis=-1)
    return (alpha[..., None] * u).sum(-2) @ ws + bs


def cascade_decoder(hidden, tables, mixers):
    """Sec. 3.3. mixers: list of (w_dn [2d, m], b_dn, w_up [m, d], b_up)."""
    c = hidden
    logits = []
    for i in range(tables.shape[0]):
        o = c @ tables[i].T
        logits.append(o)
        if i < tables.shape[0] - 1:
            s = softmax(o) @ tables[i]
            w_dn, b_dn, w_up, b_up = mixers[i]
            c = c + silu(np.concatenate([c, s], -1) @ w_dn + b_dn) @ w_up + b_up
    return np.stack(logits, -2)


def signature_loss(logits, target_signatures, weights=None):
    """Sec. 3.4: sum over heads of CE, averaged over weighted positions."""
    lp = log_softmax(logits)
    picked = np.take_along_axis(lp, target_signatures[..., None], -1)[..., 0]
    per_position = -picked.sum(-1)
    if weights is None:
        weights = np.ones(per_position.shape)
    return (per_position * weights).sum() / weights.sum()


def token_log_probs(logits, signatures):
    """Sec. 3.4 inference: sum_i log p_i(bucket_i(w)), log-softmax over V."""
    lp = log_softmax(logits)
    scores = sum(lp[..., i, :][..., signatures[:, i]] for i in range(signatures.shape[1]))
    return log_softmax(scores)


def rms_norm(x, scale, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale
