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


def token_log_probs(logits, signatures, temperature=1.0):
    """Sec. 3.4 inference: s(w) = sum_i log p_i(bucket_i(w)), then
    log_softmax_V(s(w) / temperature)."""
    lp = log_softmax(logits)
    scores = sum(
        lp[..., i, :][..., signatures[:, i]] for i in range(signatures.shape[1])
    )
    return log_softmax(scores / temperature)


def rms_norm(x, scale, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def rope(x, positions, theta):
    """HF Qwen3 rotary embedding on [s, heads, hd] (rotate_half convention)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], -1)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    rotated = np.concatenate([-x2, x1], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def qwen3_block(x, w, cfg):
    """One HF Qwen3 decoder layer on a single sequence x [s, d]; w holds the
    torch-layout ([out, in]) tensors of `model.layers.N.*`."""
    s = x.shape[0]
    nq, nkv, hd, eps = cfg["nq"], cfg["nkv"], cfg["hd"], cfg["eps"]
    h = rms_norm(x, w["input_layernorm.weight"], eps)
    q = (h @ w["self_attn.q_proj.weight"].T).reshape(s, nq, hd)
    k = (h @ w["self_attn.k_proj.weight"].T).reshape(s, nkv, hd)
    v = (h @ w["self_attn.v_proj.weight"].T).reshape(s, nkv, hd)
    q = rms_norm(q, w["self_attn.q_norm.weight"], eps)
    k = rms_norm(k, w["self_attn.k_norm.weight"], eps)
    pos = np.arange(s, dtype="float64")
    q, k = rope(q, pos, cfg["theta"]), rope(k, pos, cfg["theta"])
    k = np.repeat(k, nq // nkv, axis=1)
    v = np.repeat(v, nq // nkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((s, s), bool))[None], scores, -np.inf)
    attn = np.einsum("hqk,khd->qhd", softmax(scores), v).reshape(s, nq * hd)
    x = x + attn @ w["self_attn.o_proj.weight"].T
    h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
    gate = silu(h @ w["mlp.gate_proj.weight"].T)
    up = h @ w["mlp.up_proj.weight"].T
    return x + (gate * up) @ w["mlp.down_proj.weight"].T


def authors_model_bucket_logits(token_ids, tensors, cfg):
    """Bucket logits [s, H, B] of the authors' model for one sequence, from
    the raw checkpoint tensors (torch layout), by the paper's equations."""
    H, B = cfg["num_hashes"], cfg["num_buckets"]
    t = {
        k[len("model.") :] if k.startswith("model.") else k: v
        for k, v in tensors.items()
    }
    tables = t["embed_tokens.weight"].reshape(H, B, -1)
    sig = t["hash_map"][token_ids]
    x = hash_encoder(
        sig,
        tables,
        t["combiner.scorer.0.weight"].T,
        t["combiner.scorer.0.bias"],
        t["combiner.scorer.2.weight"].T,
        t["combiner.scorer.2.bias"],
        t["combiner.output_proj.0.weight"].T,
        t["combiner.output_proj.0.bias"],
    )
    for n in range(cfg["layers"]):
        prefix = f"layers.{n}."
        w = {k[len(prefix) :]: v for k, v in t.items() if k.startswith(prefix)}
        x = qwen3_block(x, w, cfg)
    x = rms_norm(x, t["norm.weight"], cfg["eps"])
    mixers = [
        (
            t[f"hash_head.cascade_mixer.{k}.0.weight"].T,
            t[f"hash_head.cascade_mixer.{k}.0.bias"],
            t[f"hash_head.cascade_mixer.{k}.2.weight"].T,
            t[f"hash_head.cascade_mixer.{k}.2.bias"],
        )
        for k in range(H - 1)
    ]
    return cascade_decoder(x, tables, mixers)
