"""Exact next-token decoding that does not scan the vocabulary.

The score of a token is additive over heads, `s(w) = sum_i log p_i(h_i(w))`,
and each head's `log p_i` over its `B` buckets is known before any token is
scored. For greedy and top-k generation, `candidate_top_k` takes each head's
top-`K` buckets, collects the tokens that sit in them (through the inverted
index `SignatureLookup.bucket_tokens` / `bucket_starts`; a token found through
several heads is kept once), scores only those candidates exactly, and
certifies the answer: a token outside the candidates has, in every head, a
bucket outside that head's top `K`, so `s(w) <= sum_i t_i` with `t_i` the
head's `(K+1)`-th best log-probability (float addition is monotone, so the
bound also holds in float32). If the k-th best candidate beats the bound the
candidates' top-k is the vocabulary's; otherwise the step falls back to the
full scan (`full_top_k`) inside the same compiled step.

Both decodings share everything else (scores summed in the same head order,
ties broken towards the lowest token id, the same sampling code), so
`decoding="candidates"` returns exactly the tokens of `decoding="full"` for
the greedy and top-k samplers. Other samplers need the whole distribution and
use KerasHub's own samplers on `log_softmax_V(s / tau)`.
"""

import keras_hub
from keras import ops
from keras import random
from keras_hub.src.utils.tensor_utils import any_equal

# Candidates aimed at per row when K is chosen automatically.
CANDIDATE_BUDGET = 4096
# With K chosen automatically, vocabularies up to this size are scanned
# whole: measured on CPU (JAX, d=128, H4 B16384, tools/benchmark.py
# --inference vocabulary), the full scan took 2.7 ms per token at 32K and
# 2.5 ms at 131K against the search's 3.5 and 3.9 ms; at 1M the search took
# 3.5 ms against 7.2 ms. Both give the same tokens.
CANDIDATE_MIN_VOCABULARY = 2**18
MIN_CANDIDATE_BUCKETS, MAX_CANDIDATE_BUCKETS = 4, 64


class DecodingStatistics:
    """Generation steps of a model and how many of them fell back to the
    full scan (updated once per `generate` call, on the host)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.steps = 0
        self.fallbacks = 0

    @property
    def fallback_rate(self):
        return self.fallbacks / self.steps if self.steps else 0.0

    def __repr__(self):
        return (
            f"DecodingStatistics(steps={self.steps}, fallbacks="
            f"{self.fallbacks}, fallback_rate={self.fallback_rate:.3f})"
        )


def automatic_candidate_buckets(max_bucket_loads):
    """`K` from the table: about `CANDIDATE_BUDGET` candidates per row,
    between 4 and 64 buckets per head."""
    per_bucket = max(1, sum(max_bucket_loads))
    k = CANDIDATE_BUDGET // per_bucket
    return int(min(MAX_CANDIDATE_BUCKETS, max(MIN_CANDIDATE_BUCKETS, k)))


def sampler_top_k(sampler):
    """How many top tokens a sampler needs (`1` greedy, `k` top-k), or
    `None` when it needs the whole distribution."""
    if type(sampler) is keras_hub.samplers.GreedySampler:
        return 1
    if type(sampler) is keras_hub.samplers.TopKSampler:
        return int(sampler.k)
    return None


def head_log_probs(causal_lm, hidden_states):
    """Final hidden states `[b, d]` -> per-head bucket log-probs `[b, H, B]`
    (float32)."""
    logits = ops.cast(causal_lm.bucket_logits(hidden_states), "float32")
    return ops.log_softmax(logits, axis=-1)


def _top_k_lowest_id(scores, token_ids, k):
    """The `k` best `(score, token id)` pairs per row, best first, equal
    scores ordered by token id. `scores`, `token_ids`: `[b, n]`."""
    big = ops.cast(2**31 - 1, "int32")
    values, chosen = [], []
    for _ in range(k):
        best = ops.max(scores, axis=-1)
        ties = scores == best[:, None]
        pick = ops.min(ops.where(ties, token_ids, big), axis=-1)
        values.append(best)
        chosen.append(pick)
        scores = ops.where(token_ids == pick[:, None], float("-inf"), scores)
    return ops.stack(values, axis=-1), ops.stack(chosen, axis=-1)


def full_scores(lookup, log_probs):
    """`s(w)` for all V tokens `[b, V]`, summed over heads in order (as
    `SignatureLookup.token_log_probs`)."""
    table = ops.convert_to_tensor(lookup.signatures)
    scores = None
    for i in range(lookup.num_hashes):
        head = ops.take(log_probs[:, i, :], table[:, i], axis=-1)
        scores = head if scores is None else scores + head
    return scores


def full_top_k(lookup, log_probs, k):
    """Top-k of the whole vocabulary (the reference and the fallback)."""
    scores = full_scores(lookup, log_probs)
    batch = ops.shape(scores)[0]
    ids = ops.broadcast_to(
        ops.arange(lookup.vocabulary_size, dtype="int32")[None, :],
        (batch, lookup.vocabulary_size),
    )
    return _top_k_lowest_id(scores, ids, k)


def candidate_top_k(lookup, log_probs, k, candidate_buckets):
    """Top-k from the candidates of each head's top `candidate_buckets`
    buckets: `(values [b, k], ids [b, k], certified)`, `certified` a scalar
    bool that is true when every row's answer is provably the vocabulary's
    (see the module docstring)."""
    table = ops.convert_to_tensor(lookup.signatures)
    vocabulary = lookup.vocabulary_size
    heads = lookup.num_hashes
    top_buckets, bound = [], None
    for i in range(heads):
        head = log_probs[:, i, :]
        # Two top-k calls whose outputs are used whole: XLA:CPU lowers a
        # top-k whose outputs are sliced to a full sort (40x slower here).
        _, buckets = ops.top_k(head, candidate_buckets)
        values, _ = ops.top_k(head, candidate_buckets + 1)
        top_buckets.append(buckets)
        threshold = ops.min(values, axis=-1)  # the (K+1)-th best
        bound = threshold if bound is None else bound + threshold
    candidates, valid = [], []
    for i in range(heads):
        width = lookup.max_bucket_load[i]
        starts = ops.take(lookup.bucket_starts[i], top_buckets[i], axis=0)
        ends = ops.take(lookup.bucket_starts[i], top_buckets[i] + 1, axis=0)
        positions = starts[..., None] + ops.arange(width, dtype="int32")
        inside = positions < ends[..., None]  # [b, K, width]
        positions = ops.minimum(positions, vocabulary - 1)
        tokens = ops.take(lookup.bucket_tokens[i], positions, axis=0)
        tokens = ops.reshape(tokens, (ops.shape(tokens)[0], -1))
        inside = ops.reshape(inside, ops.shape(tokens))
        signatures = ops.take(table, tokens, axis=0)  # [b, n, H]
        # Keep a token once: drop it from head i if an earlier head's top
        # buckets already hold it.
        for j in range(i):
            seen = ops.any(
                signatures[..., j, None] == top_buckets[j][:, None, :], axis=-1
            )
            inside = ops.logical_and(inside, ops.logical_not(seen))
        candidates.append(tokens)
        valid.append(inside)
    tokens = ops.concatenate(candidates, axis=-1)
    valid = ops.concatenate(valid, axis=-1)
    signatures = ops.take(table, tokens, axis=0)
    scores = None
    for i in range(heads):
        head = ops.take_along_axis(log_probs[:, i, :], signatures[..., i], -1)
        scores = head if scores is None else scores + head
    scores = ops.where(valid, scores, float("-inf"))
    values, ids = _top_k_lowest_id(scores, tokens, k)
    certified = ops.all(values[:, -1] > bound)
    return values, ids, certified


def uses_candidate_search(causal_lm):
    """Whether greedy / top-k steps search bucket candidates: for
    `decoding="candidates"` with `candidate_buckets` set, or with it
    automatic and a vocabulary larger than `CANDIDATE_MIN_VOCABULARY`."""
    if causal_lm.decoding != "candidates":
        return False
    if causal_lm.candidate_buckets is not None:
        return True
    vocabulary_size = causal_lm.backbone.signature_lookup.vocabulary_size
    return vocabulary_size > CANDIDATE_MIN_VOCABULARY


def next_token(causal_lm, hidden_states, sampler, k):
    """One step: `(next token ids [b], fell back to the full scan)`."""
    lookup = causal_lm.backbone.signature_lookup
    log_probs = head_log_probs(causal_lm, hidden_states)
    if uses_candidate_search(causal_lm):
        buckets = min(
            max(causal_lm.resolved_candidate_buckets(), k),
            lookup.num_buckets - 1,
        )
        values, ids, certified = candidate_top_k(lookup, log_probs, k, buckets)
        values, ids = ops.cond(
            certified,
            lambda: (values, ids),
            lambda: full_top_k(lookup, log_probs, k),
        )
        fallback = ops.cast(ops.logical_not(certified), "int32")
    else:
        values, ids = full_top_k(lookup, log_probs, k)
        fallback = ops.convert_to_tensor(0, "int32")
    if k == 1:
        return ids[:, 0], fallback
    logits = values / (causal_lm.scoring_temperature * sampler.temperature)
    picked = random.categorical(
        logits, 1, seed=sampler.seed_generator, dtype="int32"
    )
    return ops.take_along_axis(ids, picked, axis=-1)[:, 0], fallback


def generate_step(causal_lm, inputs, stop_token_ids, k):
    """KerasHub's generation loop (prompt mask, stop tokens, KV cache) with
    the greedy / top-k choice made by `next_token`. Returns the usual
    outputs plus `"candidate_fallbacks"` (steps that scanned the whole
    vocabulary) and `"decoding_steps"`."""
    token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
    _, cache = causal_lm._build_cache(token_ids)
    row_lengths = ops.sum(ops.cast(padding_mask, "int32"), axis=-1)
    index = ops.cast(ops.min(row_lengths), "int32")
    max_length = ops.cast(ops.shape(token_ids)[-1], "int32")
    mask = ops.cast(padding_mask, "bool")
    sampler = causal_lm.sampler

    def cond(prompt, cache, index, fallbacks, steps):
        if stop_token_ids is None:
            return ops.convert_to_tensor(True, dtype="bool")
        end_tokens = any_equal(prompt, stop_token_ids, ops.logical_not(mask))
        return ops.logical_not(ops.all(ops.any(end_tokens, axis=-1)))

    def body(prompt, cache, index, fallbacks, steps):
        batch_size = ops.shape(prompt)[0]
        previous = ops.slice(prompt, [0, index - 1], [batch_size, 1])
        hidden, cache = causal_lm._trunk_with_cache(previous, cache, index - 1)
        chosen, fallback = next_token(causal_lm, hidden[:, 0], sampler, k)
        chosen = ops.cast(chosen, prompt.dtype)
        chosen = ops.where(mask[:, index], prompt[:, index], chosen)
        prompt = ops.slice_update(prompt, [0, index], chosen[:, None])
        return prompt, cache, index + 1, fallbacks + fallback, steps + 1

    zero = ops.convert_to_tensor(0, "int32")
    token_ids, _, _, fallbacks, steps = sampler.run_loop(
        cond,
        body,
        loop_vars=(token_ids, cache, index, zero, zero),
        maximum_iterations=max_length - index,
        model=causal_lm,
    )
    if stop_token_ids is not None:
        end_locations = any_equal(
            token_ids, stop_token_ids, ops.logical_not(mask)
        )
        end_locations = ops.cast(end_locations, "int32")
        cumsum = ops.cast(ops.cumsum(end_locations, axis=-1), "int32")
        overflow = cumsum - end_locations
        padding_mask = ops.logical_not(ops.cast(overflow, "bool"))
    else:
        padding_mask = ops.ones_like(token_ids, dtype="bool")
    return {
        "token_ids": token_ids,
        "padding_mask": padding_mask,
        "candidate_fallbacks": fallbacks,
        "decoding_steps": steps,
    }
