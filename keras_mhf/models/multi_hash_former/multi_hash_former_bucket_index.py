"""The inverted bucket index of a signature table (paper Sec. 3.4,
inference): for each head, the tokens in each bucket, so that candidate
decoding (`multi_hash_former_decoding`) finds the tokens of a head's best
buckets without scanning the vocabulary."""

import keras
import numpy as np


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
