"""MultiHashFormer inference (paper Sec. 3.4, "Inference Phase"): from the
cascade's per-head bucket logits to tokens. Scoring, generation, evaluation,
calibration and export all go through this module.

The score of a token is additive over heads, `s(w) = sum_i log p_i(h_i(w))`
(`token_scores`, the one place the heads are summed, always in head order so
that every path gives the same floats), and the distribution is
`log_softmax_V(s(w) / tau)` (`token_log_probs`). `vocabulary_statistics`
scans the vocabulary in chunks with an online log-sum-exp, so scoring and
evaluation never form `[..., V]`.

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
token. Both decodings break
ties towards the lowest token id and sample with the same code, so
`decoding="candidates"` returns exactly the tokens of `decoding="full"`.
Other samplers need the whole distribution and use KerasHub's samplers on
`log_softmax_V(s / tau)` (`sampled_generate_step`).
"""

import keras
import keras_hub
import numpy as np
from keras import ops
from keras import random

from keras_mhf.utils.keras_utils import check_positive_ints
from keras_mhf.utils.keras_utils import dense_layout
from keras_mhf.utils.token_ids import check_token_ids

# Candidates aimed at per row when K is chosen automatically.
CANDIDATE_BUDGET = 4096
# With K chosen automatically, vocabularies up to this size are scanned
# whole (the search is faster only above it; tools/benchmark.py --inference
# vocabulary measures the crossover). Both give the same tokens.
CANDIDATE_MIN_VOCABULARY = 2**18
MIN_CANDIDATE_BUCKETS, MAX_CANDIDATE_BUCKETS = 4, 64
DECODINGS = ("candidates", "full")
# Scores held at a time by the vocabulary scan (4 MB of float32; against
# 16 MB, 1,016 positions, V = 32K, 2 cores under load: 8-9% faster on JAX,
# 1-4% on TensorFlow, 17-24% on PyTorch).
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
    `[B, n]` layout, so the heads are never stacked into `[n, H, B]` (on
    PyTorch, 1,024 positions at H4 B16384: the stack and the separate
    log-softmax cost 185 ms of a 1 s score)."""
    return _scan(
        head_logits, True, signatures, targets, temperature, with_argmax
    )


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
    gathering a chunk of tokens reads whole contiguous rows. (The eager
    PyTorch transpose copy took 72 ms per head at n = 1,024, B = 16,384, 2
    cores; compiled, about half, with the log-softmax in the same pass.)"""
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


# --- The inverted bucket index --------------------------------------------


class BucketIndex(keras.layers.Layer):
    """The inverted index of a signature table (bucket -> tokens), per head,
    in CSR form: `bucket_tokens[i]` lists the token ids sorted by their head-i
    bucket and `bucket_starts[i][b]` is where bucket b starts.

    Derived from the table, never saved: `refresh(lookup)` rebuilds it
    whenever the lookup's `table_version` changed (on the host, before
    generation is compiled). Non-trainable variables, so compiled generation
    receives it as state rather than as constants.

    Args:
        vocabulary_size: int, `V`.
        num_hashes: int, `H`.
        num_buckets: int, `B`.
        **kwargs: standard `keras.layers.Layer` arguments.
    """

    @classmethod
    def for_lookup(cls, lookup, **kwargs):
        """A built, empty index shaped for a `SignatureLookup`'s table."""
        index = cls(
            lookup.vocabulary_size,
            lookup.num_hashes,
            lookup.num_buckets,
            **kwargs,
        )
        index.build()  # filled by `refresh`, before generation
        return index

    def __init__(self, vocabulary_size, num_hashes, num_buckets, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size = int(vocabulary_size)
        self.num_hashes = int(num_hashes)
        self.num_buckets = int(num_buckets)
        self.table_version = None
        self.max_bucket_load = (1,) * self.num_hashes

    def build(self, input_shape=None):
        def int_weight(name, size):
            return self.add_weight(
                name=name,
                shape=(size,),
                dtype="int32",
                initializer="zeros",
                trainable=False,
            )

        heads = range(self.num_hashes)
        self.bucket_tokens = [
            int_weight(f"bucket_tokens_{i}", self.vocabulary_size)
            for i in heads
        ]
        self.bucket_starts = [
            int_weight(f"bucket_starts_{i}", self.num_buckets + 1)
            for i in heads
        ]
        self.built = True

    def refresh(self, lookup):
        """Rebuilds the index from `lookup`'s table if it changed since the
        last refresh; returns the table version it describes."""
        if not self.built:
            self.build()
        if self.table_version == lookup.table_version:
            return self.table_version
        table = lookup.get_signatures()
        loads = []
        for i in range(self.num_hashes):
            order = np.argsort(table[:, i], kind="stable").astype("int32")
            counts = np.bincount(table[:, i], minlength=self.num_buckets)
            starts = np.concatenate([[0], np.cumsum(counts)]).astype("int32")
            self.bucket_tokens[i].assign(order)
            self.bucket_starts[i].assign(starts)
            loads.append(int(counts.max()))
        # Python ints: compiled decoding reads them as static shapes.
        self.max_bucket_load = tuple(loads)
        self.table_version = lookup.table_version
        return self.table_version

    def quantize(self, mode=None, type_check=True, config=None):
        """Nothing to quantize (int token ids)."""

    def save_own_variables(self, store):
        """Nothing to save: the index is derived from the table."""

    def load_own_variables(self, store):
        """Nothing to load; the next `refresh` rebuilds the index."""
        self.table_version = None


def has_task_weights(causal_lm):
    """Whether a task has weights outside its backbone that need saving;
    its bucket index is derived from the table and never saved, so it does
    not count."""
    derived = {id(w) for w in causal_lm.bucket_index.weights}
    inside = {id(w) for w in causal_lm.backbone.weights} | derived
    return any(id(w) not in inside for w in causal_lm.weights)


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
    logits = values / (causal_lm.scoring_temperature * sampler.temperature)
    picked = random.categorical(
        logits, 1, seed=sampler.seed_generator, dtype="int32"
    )
    return ops.take_along_axis(ids, picked, axis=-1)[:, 0], fallback


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


def empty_cache(backbone, token_ids, dtype):
    """A zero KV cache for prompts `token_ids [b, max_length]`."""
    batch_size, max_length = ops.shape(token_ids)[0], ops.shape(token_ids)[1]
    shape = [
        batch_size,
        backbone.num_layers,
        2,
        max_length,
        backbone.num_key_value_heads,
        backbone.head_dim,
    ]
    return ops.zeros(shape, dtype=dtype)


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


def _any_stop_token(token_ids, stop_token_ids, mask):
    """`[b, s]` bool: a stop token at a generated (unmasked) position."""
    hits = ops.zeros_like(token_ids, dtype="bool")
    for stop in stop_token_ids:
        hits = ops.logical_or(hits, token_ids == stop)
    return ops.logical_and(hits, mask)


def _outputs(token_ids, stop_token_ids, mask, **extra):
    """KerasHub's generation outputs: the ids and a padding mask that ends
    after each row's first generated stop token."""
    if stop_token_ids is None:
        padding_mask = ops.ones_like(token_ids, dtype="bool")
    else:
        ends = ops.cast(
            _any_stop_token(token_ids, stop_token_ids, ops.logical_not(mask)),
            "int32",
        )
        overflow = ops.cast(ops.cumsum(ends, axis=-1), "int32") - ends
        padding_mask = ops.logical_not(ops.cast(overflow, "bool"))
    return {"token_ids": token_ids, "padding_mask": padding_mask, **extra}


def _stopped(prompt, stop_token_ids, mask):
    if stop_token_ids is None:
        return ops.convert_to_tensor(True, dtype="bool")
    ends = _any_stop_token(prompt, stop_token_ids, ops.logical_not(mask))
    return ops.logical_not(ops.all(ops.any(ends, axis=-1)))


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


def top_k_generate_step(causal_lm, inputs, stop_token_ids, cache, k):
    """KerasHub's generation loop (prompt mask, stop tokens, KV cache) with
    the greedy / top-k choice made by `next_token`. `cache` is the prompt's
    (`causal_lm._build_cache`). Returns the usual outputs plus
    `"candidate_fallbacks"` (steps that scanned the whole vocabulary) and
    `"decoding_steps"`."""
    token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
    row_lengths = ops.sum(ops.cast(padding_mask, "int32"), axis=-1)
    index = ops.cast(ops.min(row_lengths), "int32")
    max_length = ops.cast(ops.shape(token_ids)[-1], "int32")
    mask = ops.cast(padding_mask, "bool")
    sampler = causal_lm.sampler

    def cond(prompt, cache, index, fallbacks, steps, backoff):
        return _stopped(prompt, stop_token_ids, mask)

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
    token_ids, _, _, fallbacks, steps, _ = sampler.run_loop(
        cond,
        body,
        loop_vars=(token_ids, cache, index, zero, zero, ops.zeros(2, "int32")),
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
