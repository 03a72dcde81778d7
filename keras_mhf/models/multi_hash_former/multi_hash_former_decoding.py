"""MultiHashFormer generation (paper Sec. 3.4, "Inference Phase"): the
next token from the cascade's bucket logits, with a KV cache.

For greedy and top-k generation, `candidate_top_k` does not scan the
vocabulary: it takes each head's top-`K` buckets, collects the tokens that sit
in them through the inverted index (`BucketIndex`; a token found through
several heads is kept once), scores only those candidates exactly, and
certifies the answer: a token outside the candidates has, in every head, a
bucket outside that head's top `K`, so `s(w) <= sum_i t_i` with `t_i` the
head's `(K+1)`-th best log-probability (float addition is monotone, so the
bound also holds in float32). If the k-th best candidate beats the bound the
candidates' top-k is the vocabulary's; otherwise the step falls back to the
full scan (`full_top_k`) inside the same compiled step, and the next steps
scan without searching first (1, 2, 4, ... up to `MAX_SCAN_BACKOFF` steps
after consecutive failures, reset by a certified step), so a model whose
heads disagree pays about the scan, not the search plus the scan, per
token. Both decodings break ties towards the lowest token id and sample with
the same code, so `decoding="candidates"` returns exactly the tokens of
`decoding="full"`. Other samplers need the whole distribution and use
KerasHub's samplers on `log_softmax_V(s / tau)` (`sampled_generate_step`).
"""

import keras_hub
from keras import ops
from keras import random

from keras_mhf.models.generation_stream import any_stop_token
from keras_mhf.models.generation_stream import stop_condition
from keras_mhf.models.multi_hash_former.multi_hash_former_inference import heads
from keras_mhf.models.multi_hash_former.multi_hash_former_inference import (
    sum_over_heads,
)
from keras_mhf.models.multi_hash_former.multi_hash_former_inference import (
    token_scores,
)
from keras_mhf.utils.arguments import check_positive_ints
from keras_mhf.utils.token_ids import check_token_ids

# Candidates aimed at per row when K is chosen automatically.
CANDIDATE_BUDGET = 4096
# With K chosen automatically, vocabularies up to this size are scanned
# whole (the search is faster only above it; `python -m benchmarks.benchmark
# --inference vocabulary` measures the crossover). Both give the same tokens.
CANDIDATE_MIN_VOCABULARY = 2**18
MIN_CANDIDATE_BUCKETS, MAX_CANDIDATE_BUCKETS = 4, 64
DECODINGS = ("candidates", "full")


# --- Candidate decoding ------------------------------------------------------


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


def check_decoding(decoding, candidate_buckets):
    """The task's decoding settings: returns `candidate_buckets` as an int
    (or `None`), with a clear error for a bad value."""
    if decoding not in DECODINGS:
        raise ValueError(
            f"decoding must be one of {DECODINGS}; got {decoding!r}."
        )
    if candidate_buckets is None:
        return None
    check_positive_ints(
        "MultiHashFormerCausalLM", candidate_buckets=candidate_buckets
    )
    return int(candidate_buckets)


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


def full_top_k(signatures, log_probs, k):
    """Top-k of the whole vocabulary (the reference and the fallback):
    `(values [b, k], ids [b, k])` for log-probs `[b, H, B]`."""
    scores = token_scores(log_probs, signatures)
    vocabulary_size = signatures.shape[0]
    ids = ops.broadcast_to(
        ops.arange(vocabulary_size, dtype="int32")[None, :],
        ops.shape(scores),
    )
    return _top_k_lowest_id(scores, ids, k)


def _head_candidates(index, head, top_buckets, vocabulary_size):
    """Tokens in head `head`'s top buckets `[b, K]`: `(tokens [b, n],
    inside [b, n])`, `inside` false for the padding of smaller buckets."""
    width = index.max_bucket_load[head]
    starts = ops.take(index.bucket_starts[head], top_buckets, axis=0)
    ends = ops.take(index.bucket_starts[head], top_buckets + 1, axis=0)
    positions = starts[..., None] + ops.arange(width, dtype="int32")
    inside = positions < ends[..., None]  # [b, K, width]
    positions = ops.minimum(positions, vocabulary_size - 1)
    tokens = ops.take(index.bucket_tokens[head], positions, axis=0)
    tokens = ops.reshape(tokens, (ops.shape(tokens)[0], -1))
    return tokens, ops.reshape(inside, ops.shape(tokens))


def candidate_top_k(signatures, index, log_probs, k, candidate_buckets):
    """Top-k from the candidates of each head's top `candidate_buckets`
    buckets: `(values [b, k], ids [b, k], certified)`, `certified` a scalar
    bool that is true when every row's answer is provably the vocabulary's
    (see the module docstring). `index` is the table's `BucketIndex`."""
    table = ops.convert_to_tensor(signatures)
    vocabulary_size, heads = signatures.shape
    top_buckets, thresholds = [], []
    for i in range(heads):
        head = log_probs[:, i, :]
        # Two top-k calls whose outputs are used whole: XLA:CPU lowers a
        # top-k whose outputs are sliced to a full sort.
        _, buckets = ops.top_k(head, candidate_buckets)
        values, _ = ops.top_k(head, candidate_buckets + 1)
        top_buckets.append(buckets)
        thresholds.append(ops.min(values, axis=-1))  # the (K+1)-th best
    bound = sum_over_heads(heads, lambda i: thresholds[i])
    candidates, valid = [], []
    for i in range(heads):
        tokens, inside = _head_candidates(
            index, i, top_buckets[i], vocabulary_size
        )
        rows = ops.take(table, tokens, axis=0)  # [b, n, H]
        # Keep a token once: drop it from head i if an earlier head's top
        # buckets already hold it.
        for j in range(i):
            seen = ops.any(
                rows[..., j, None] == top_buckets[j][:, None, :], axis=-1
            )
            inside = ops.logical_and(inside, ops.logical_not(seen))
        candidates.append(tokens)
        valid.append(inside)
    tokens = ops.concatenate(candidates, axis=-1)
    valid = ops.concatenate(valid, axis=-1)
    rows = ops.take(table, tokens, axis=0)
    scores = token_scores(log_probs, rows, per_position=True)
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


def resolved_candidate_buckets(causal_lm):
    """`K` of a task: its `candidate_buckets`, or chosen from its (refreshed)
    bucket index's loads (about `CANDIDATE_BUDGET` candidates per row);
    below `num_buckets`."""
    lookup = causal_lm.backbone.signature_lookup
    causal_lm.bucket_index.refresh(lookup)
    candidate_buckets = causal_lm.candidate_buckets
    if candidate_buckets is None:
        candidate_buckets = automatic_candidate_buckets(
            causal_lm.bucket_index.max_bucket_load
        )
    return min(candidate_buckets, lookup.num_buckets - 1)


def next_token(causal_lm, hidden_states, sampler, k, scan_only=None):
    """One step: `(next token ids [b], scanned the whole vocabulary)`.
    `scan_only` (a scalar bool, optional): skip the candidate search and
    scan the vocabulary (the backoff of `top_k_generate_step`); the same
    tokens either way."""
    lookup = causal_lm.backbone.signature_lookup
    log_probs, signatures = heads(causal_lm, hidden_states)
    if uses_candidate_search(causal_lm):
        buckets = min(
            max(resolved_candidate_buckets(causal_lm), k),
            lookup.num_buckets - 1,
        )

        def scan():
            values, ids = full_top_k(signatures, log_probs, k)
            return values, ids, ops.convert_to_tensor(True)

        def search():
            values, ids, certified = candidate_top_k(
                signatures, causal_lm.bucket_index, log_probs, k, buckets
            )
            return ops.cond(
                certified,
                lambda: (values, ids, ops.convert_to_tensor(False)),
                scan,
            )

        if scan_only is None:
            values, ids, scanned = search()
        else:
            values, ids, scanned = ops.cond(scan_only, scan, search)
        fallback = ops.cast(scanned, "int32")
    else:
        values, ids = full_top_k(signatures, log_probs, k)
        fallback = ops.convert_to_tensor(0, "int32")
    if k == 1:
        return ids[:, 0], fallback
    picked = draw_with_top_k_sampler(
        sampler, values, causal_lm.scoring_temperature
    )
    return ops.take_along_axis(ids, picked, axis=-1)[:, 0], fallback


def draw_with_top_k_sampler(sampler, values, scoring_temperature):
    """One draw per row among the `k` best tokens for a KerasHub
    `TopKSampler`: positions `[b, 1]` (int32) into `values [b, k]`, the
    tokens' log-probs best first, sampled from `values / (scoring_temperature
    * sampler.temperature)` with the sampler's own random stream.

    The only place that reads the sampler's attributes `temperature` and
    `seed_generator` (set by its constructor, not a documented API; the
    stream is one of `sampler.variables`, which `sampler.run_loop` carries
    through the compiled loop). KerasHub 0.32's public sampling step,
    `get_next_token(compute_probabilities(logits))`, does not give these
    tokens: `compute_probabilities` is `softmax(logits / temperature)`
    (dividing by `scoring_temperature`, then by `temperature`, rounds
    differently from dividing by their product), `TopKSampler.get_next_token`
    draws from `log(probabilities)` (an exp/log round trip; a probability
    that underflows to 0 can never be drawn) and first re-selects its
    input with `ops.top_k(probabilities, k, sorted=False)`, whose order
    PyTorch does not keep, so the same seed picks other tokens there. No
    public method draws from given logits with the sampler's seed."""
    logits = values / (scoring_temperature * sampler.temperature)
    return random.categorical(
        logits, 1, seed=sampler.seed_generator, dtype="int32"
    )


# --- The trunk with a KV cache -----------------------------------------------


def trunk_with_cache(backbone, token_ids, cache, cache_update_index):
    """The trunk on `token_ids [b, s]` with a KV cache `[b, num_layers, 2,
    max_length, num_kv_heads, head_dim]`: `(hidden_states, cache)`."""
    x = backbone.embed(token_ids)
    updated = []
    for i, block in enumerate(backbone.transformer_layers):
        x, next_cache = block(
            x,
            self_attention_cache=cache[:, i, ...],
            self_attention_cache_update_index=cache_update_index,
        )
        updated.append(next_cache)
    return backbone.layer_norm(x), ops.stack(updated, axis=1)


# --- Generation loops --------------------------------------------------------


def cached_generate_function(causal_lm, make_compiled):
    """The task's generation function: `make_compiled()` (KerasHub's
    `make_generate_function`) wrapped by `counted_generate_function`, built
    again when the table version or the decoding settings changed."""
    version = causal_lm.bucket_index.refresh(
        causal_lm.backbone.signature_lookup
    )
    key = (version, causal_lm.decoding, causal_lm.candidate_buckets)
    cached = causal_lm.generate_function
    if cached is None or key != getattr(cached, "decoding_key", None):
        causal_lm.generate_function = None  # KerasHub builds only if None
        cached = counted_generate_function(
            make_compiled(),
            causal_lm.backbone.vocabulary_size,
            causal_lm.decoding_statistics,
        )
        cached.decoding_key = key
        causal_lm.generate_function = cached
    return cached


def counted_generate_function(compiled, vocabulary_size, statistics):
    """Wraps KerasHub's compiled generation function: checks the prompt's
    token ids on the host (once per call, not per token) and adds the
    candidate-search fallbacks of the call to `statistics`."""

    def generate_function(inputs, stop_token_ids=None):
        check_token_ids(inputs["token_ids"], vocabulary_size)
        outputs = dict(compiled(inputs, stop_token_ids))
        fallbacks = outputs.pop("candidate_fallbacks", None)
        steps = outputs.pop("decoding_steps", None)
        if steps is not None:
            statistics.steps += int(ops.convert_to_numpy(steps))
            statistics.fallbacks += int(ops.convert_to_numpy(fallbacks))
        return outputs

    return generate_function


def _outputs(token_ids, stop_token_ids, mask, **extra):
    """KerasHub's generation outputs: the ids and a padding mask that ends
    after each row's first generated stop token."""
    if stop_token_ids is None:
        padding_mask = ops.ones_like(token_ids, dtype="bool")
    else:
        ends = ops.cast(
            any_stop_token(token_ids, stop_token_ids, ops.logical_not(mask)),
            "int32",
        )
        overflow = ops.cast(ops.cumsum(ends, axis=-1), "int32") - ends
        padding_mask = ops.logical_not(ops.cast(overflow, "bool"))
    return {"token_ids": token_ids, "padding_mask": padding_mask, **extra}


# After a failed certificate the next steps scan the vocabulary without
# trying the candidates first: 1, 2, 4, ... steps after consecutive failures,
# at most this many, and none after a certified step.
MAX_SCAN_BACKOFF = 32


def _next_backoff(wait, streak, scanned):
    """`[wait, streak]` after a step: `wait` steps left that scan without
    searching, `streak` the certificates failed in a row. A step that
    waited counts down; a failed search doubles the wait; a certified one
    resets both."""
    searched = wait == 0
    failed = ops.logical_and(searched, scanned > 0)
    streak = ops.where(failed, streak + 1, ops.where(searched, 0, streak))
    doubled = ops.minimum(
        ops.left_shift(
            ops.convert_to_tensor(1, "int32"), ops.maximum(streak - 1, 0)
        ),
        MAX_SCAN_BACKOFF,
    )
    wait = ops.where(failed, doubled, ops.where(searched, 0, wait - 1))
    return ops.stack([wait, streak])


def top_k_loop(causal_lm, sampler, mask, stop_token_ids, k):
    """KerasHub's generation loop (prompt mask, stop tokens, KV cache) with
    the greedy / top-k choice made by `next_token`, over the loop variables
    `(prompt, cache, index, fallbacks, steps, backoff)`: `(cond, body, the
    last three's initial values)`. `fallbacks` counts the steps that
    scanned the whole vocabulary, `steps` the steps."""

    def cond(prompt, cache, index, fallbacks, steps, backoff):
        return stop_condition(prompt, stop_token_ids, mask)

    def body(prompt, cache, index, fallbacks, steps, backoff):
        batch_size = ops.shape(prompt)[0]
        previous = ops.slice(prompt, [0, index - 1], [batch_size, 1])
        hidden, cache = trunk_with_cache(
            causal_lm.backbone, previous, cache, index - 1
        )
        wait, streak = backoff[0], backoff[1]
        chosen, scanned = next_token(
            causal_lm, hidden[:, 0], sampler, k, scan_only=wait > 0
        )
        chosen = ops.cast(chosen, prompt.dtype)
        chosen = ops.where(mask[:, index], prompt[:, index], chosen)
        prompt = ops.slice_update(prompt, [0, index], chosen[:, None])
        return (
            prompt,
            cache,
            index + 1,
            fallbacks + scanned,
            steps + 1,
            _next_backoff(wait, streak, scanned),
        )

    zero = ops.convert_to_tensor(0, "int32")
    return cond, body, (zero, zero, ops.zeros(2, "int32"))


def top_k_generate_step(causal_lm, inputs, stop_token_ids, cache, k):
    """`top_k_loop` run to the end in one call. `cache` is the prompt's
    (`causal_lm._build_cache`). Returns the usual outputs plus
    `"candidate_fallbacks"` (steps that scanned the whole vocabulary) and
    `"decoding_steps"`."""
    token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
    row_lengths = ops.sum(ops.cast(padding_mask, "int32"), axis=-1)
    index = ops.cast(ops.min(row_lengths), "int32")
    max_length = ops.cast(ops.shape(token_ids)[-1], "int32")
    mask = ops.cast(padding_mask, "bool")
    sampler = causal_lm.sampler
    cond, body, extra = top_k_loop(causal_lm, sampler, mask, stop_token_ids, k)
    token_ids, _, _, fallbacks, steps, _ = sampler.run_loop(
        cond,
        body,
        loop_vars=(token_ids, cache, index, *extra),
        maximum_iterations=max_length - index,
        model=causal_lm,
    )
    return _outputs(
        token_ids,
        stop_token_ids,
        mask,
        candidate_fallbacks=fallbacks,
        decoding_steps=steps,
    )


def sampled_generate_step(causal_lm, inputs, stop_token_ids, hidden, cache):
    """KerasHub's `generate_step` (as its Qwen3 task writes it) for samplers
    that need the whole distribution: the sampler draws from
    `causal_lm.call_with_cache`'s token log-probs `[b, V]`. `hidden` and
    `cache` are the prompt's (`causal_lm._build_cache`)."""
    token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
    row_lengths = ops.sum(ops.cast(padding_mask, "int32"), axis=-1)
    index = ops.min(row_lengths)

    def next(prompt, cache, index):
        cache_update_index = index - 1
        batch_size = ops.shape(prompt)[0]
        prompt = ops.slice(prompt, [0, cache_update_index], [batch_size, 1])
        log_probs, hidden, cache = causal_lm.call_with_cache(
            prompt, cache, cache_update_index
        )
        return ops.squeeze(log_probs, axis=1), ops.squeeze(hidden, 1), cache

    token_ids = causal_lm.sampler(
        next=next,
        prompt=token_ids,
        cache=cache,
        index=index,
        mask=padding_mask,
        stop_token_ids=stop_token_ids,
        hidden_states=hidden,
        model=causal_lm,
    )
    return _outputs(token_ids, stop_token_ids, ops.cast(padding_mask, "bool"))
