import keras
import numpy as np
from keras import ops

from keras_mhf.signature_table import SignatureTable


@keras.saving.register_keras_serializable(package="keras_mhf")
class SignatureLookup(keras.layers.Layer):
    """Holds the `[V, H]` signature table; ids -> signatures and back.

    The table (paper Sec. 3.1, "Multi-Hash Indexing") is a non-trainable int32
    weight, so it is saved and loaded with the model's weights. `call` maps
    token ids `[...]` to signatures `[..., H]`. `token_log_probs` maps per-head
    bucket logits (or log-probs) `[..., H, B]` to token log-probabilities
    `[..., V]`: `score(w) = sum_i log_softmax(o_i)[bucket_i(w)]`, renormalised
    with a log-softmax over the `V` real tokens, in float32 (paper Sec. 3.4,
    "Inference Phase").

    `call` is pure `keras.ops`, like `keras.layers.Embedding.call`: it does
    not check ids (a host check on every call would copy the ids to the host
    on every PyTorch step and every generated token). Ids are validated once,
    with a clear error, where they enter the model: `MultiHashFormerCausalLM`'s
    `fit`, `generate` and `score` (`keras_mhf.utils.token_ids`). Out-of-range
    ids given to the layer directly are undefined: JAX clamps gathers,
    TensorFlow and PyTorch raise their own errors.

    Args:
        vocabulary_size: int, `V`.
        num_hashes: int, `H`.
        num_buckets: int, `B` (bucket 0 included).
        pad_token_id: int or `None`; informational (the table row is zeros).
        signatures: optional `SignatureTable` or int array `[V, H]` to
            initialise the table with. It is not part of `get_config`: the
            table travels in the weights, like a tokenizer's vocabulary travels
            in its assets.
        **kwargs: standard `keras.layers.Layer` arguments.

    Example:

    ```python
    table = keras_mhf.SignatureTable.from_tokens(
        ["<pad>", "a", "b", "c"], num_hashes=2, num_buckets=8, pad_token_id=0
    )
    lookup = keras_mhf.layers.SignatureLookup(4, 2, 8, 0, signatures=table)
    lookup(np.array([[1, 2, 3]]))  # int32 [1, 3, 2]
    lookup.token_log_probs(np.zeros((1, 3, 2, 8)))  # float32 [1, 3, 4]
    ```
    """

    def __init__(
        self,
        vocabulary_size,
        num_hashes,
        num_buckets,
        pad_token_id=None,
        signatures=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocabulary_size = int(vocabulary_size)
        self.num_hashes = int(num_hashes)
        self.num_buckets = int(num_buckets)
        self.pad_token_id = pad_token_id
        self._initial_signatures = (
            None if signatures is None else self._validate_table(signatures)
        )
        self.built = False

    def _validate_table(self, signatures):
        if isinstance(signatures, SignatureTable):
            if signatures.num_buckets != self.num_buckets:
                raise ValueError(
                    f"The SignatureTable was built for num_buckets="
                    f"{signatures.num_buckets}, the layer has "
                    f"{self.num_buckets}."
                )
            signatures = signatures.signatures
        signatures = np.asarray(signatures)
        expected = (self.vocabulary_size, self.num_hashes)
        if signatures.shape != expected:
            raise ValueError(
                f"Signature table has shape {signatures.shape}; expected "
                f"(vocabulary_size, num_hashes) = {expected}."
            )
        if signatures.min() < 0 or signatures.max() >= self.num_buckets:
            raise ValueError(
                "Signature table holds bucket ids outside "
                f"[0, {self.num_buckets - 1}]."
            )
        return signatures.astype("int32")

    def build(self, input_shape=None):
        initial = self._initial_signatures

        def initializer(shape, dtype=None):
            if initial is None:
                return ops.zeros(shape, dtype="int32")
            return ops.convert_to_tensor(initial, dtype="int32")

        self.signatures = self.add_weight(
            name="signatures",
            shape=(self.vocabulary_size, self.num_hashes),
            dtype="int32",
            initializer=initializer,
            trainable=False,
        )
        # The inverted index (bucket -> tokens) of every head, in CSR form:
        # `bucket_tokens_i` lists the token ids sorted by their head-i
        # bucket and `bucket_starts_i[b]` is where bucket b starts. Derived
        # from the table: not saved, rebuilt whenever the table changes.
        self.bucket_tokens = []
        self.bucket_starts = []
        for i in range(self.num_hashes):
            self.bucket_tokens.append(
                self.add_weight(
                    name=f"bucket_tokens_{i}",
                    shape=(self.vocabulary_size,),
                    dtype="int32",
                    initializer="zeros",
                    trainable=False,
                )
            )
            self.bucket_starts.append(
                self.add_weight(
                    name=f"bucket_starts_{i}",
                    shape=(self.num_buckets + 1,),
                    dtype="int32",
                    initializer="zeros",
                    trainable=False,
                )
            )
        self.built = True
        self._rebuild_index(initial)
        self._initial_signatures = None

    def _rebuild_index(self, table=None):
        """Recomputes the inverted index from the table (numpy)."""
        if table is None:
            table = self.get_signatures()
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
        self.index_version = getattr(self, "index_version", 0) + 1

    def set_signatures(self, signatures):
        """Replaces the table's values (same `[V, H]` shape)."""
        if not self.built:
            self.build()
        table = self._validate_table(signatures)
        self.signatures.assign(table)
        self._rebuild_index(table)

    def get_signatures(self):
        """Returns the table as a numpy int32 array `[V, H]`."""
        if not self.built:
            self.build()
        return np.asarray(ops.convert_to_numpy(self.signatures), "int32")

    def quantize(self, mode=None, type_check=True, config=None):
        """Nothing to quantize: the table holds int bucket ids (this keeps
        `Model.quantize` from warning that the layer cannot be quantized)."""

    def save_own_variables(self, store):
        # Only the table: the index is derived from it.
        store["0"] = self.get_signatures()

    def load_own_variables(self, store):
        if len(store.keys()) != 1:
            raise ValueError(
                f"Layer '{self.name}' expected 1 variable (the signature "
                f"table), but received {len(store.keys())} variables during "
                "loading."
            )
        self.set_signatures(np.asarray(store["0"]))

    def call(self, token_ids):
        token_ids = ops.cast(token_ids, "int32")
        return ops.take(self.signatures, token_ids, axis=0)

    def token_log_probs(self, bucket_logits, normalize=True):
        """Per-head bucket logits `[..., H, B]` -> token log-probs `[..., V]`.

        Args:
            bucket_logits: float `[..., H, B]` logits or log-probs (a
                log-softmax over `B` is applied per head, which leaves
                log-probs unchanged).
            normalize: if `True` (default), renormalise over the `V` tokens
                with a log-softmax; if `False`, return the raw sums
                `sum_i log p_i(bucket_i(w))`.

        Returns:
            float32 `[..., V]`.
        """
        if not self.built:
            self.build()
        logits = ops.cast(bucket_logits, "float32")
        log_probs = ops.log_softmax(logits, axis=-1)
        table = ops.convert_to_tensor(self.signatures)
        scores = None
        for i in range(self.num_hashes):
            head = ops.take(log_probs[..., i, :], table[:, i], axis=-1)
            scores = head if scores is None else scores + head
        if normalize:
            scores = ops.log_softmax(scores, axis=-1)
        return scores

    def token_statistics(
        self, bucket_logits, targets, temperature=1.0, with_argmax=True
    ):
        """Per-position statistics of the token distribution without forming
        `[..., V]`: `(target log-prob, top log-prob, argmax id)`, each
        `[...]`, under `log_softmax_V(s(w) / temperature)`.

        The vocabulary is scanned in chunks that stay in cache, with an
        online log-sum-exp: each head's log-probs are laid out `[B, n]` so
        that gathering a chunk of tokens reads whole contiguous rows (one per
        token) instead of `n` scattered elements. The same numbers as
        `token_log_probs` (to float32 rounding of the normaliser); ties in
        the argmax go to the lowest token id.

        Args:
            bucket_logits: float `[..., H, B]` logits or log-probs.
            targets: int `[...]` token ids.
            temperature: the scoring temperature `tau`.
            with_argmax: if `False`, the argmax id is not tracked (it costs
                a second pass over each chunk) and is returned as `-1`.
        """
        if not self.built:
            self.build()
        batch_shape = ops.shape(targets)
        logits = ops.cast(bucket_logits, "float32")
        log_probs = ops.log_softmax(logits, axis=-1)
        log_probs = ops.reshape(
            log_probs, (-1, self.num_hashes, self.num_buckets)
        )
        targets = ops.reshape(ops.cast(targets, "int32"), (-1,))
        positions = ops.shape(log_probs)[0]
        columns = [
            ops.transpose(log_probs[:, i, :]) for i in range(self.num_hashes)
        ]
        static = log_probs.shape[0]
        chunk = _chunk_size(static if isinstance(static, int) else None)
        chunks = -(-self.vocabulary_size // chunk)
        table = ops.convert_to_tensor(self.signatures)
        padded = chunks * chunk != self.vocabulary_size
        table = ops.pad(
            table, [[0, chunks * chunk - self.vocabulary_size], [0, 0]]
        )
        temperature = float(temperature)

        def body(c, carry):
            running_max, total, best, best_id = carry
            rows = ops.slice(table, [c * chunk, 0], [chunk, self.num_hashes])
            scores = None
            for i, column in enumerate(columns):
                head = ops.take(column, rows[:, i], axis=0)  # [chunk, n]
                scores = head if scores is None else scores + head
            if temperature != 1.0:
                scores = scores / temperature
            if padded:  # rows past the vocabulary never count
                ids = c * chunk + ops.arange(chunk, dtype="int32")
                scores = ops.where(
                    (ids < self.vocabulary_size)[:, None],
                    scores,
                    float("-inf"),
                )
            chunk_max = ops.max(scores, axis=0)
            new_max = ops.maximum(running_max, chunk_max)
            total = total * ops.exp(running_max - new_max) + ops.sum(
                ops.exp(scores - new_max[None, :]), axis=0
            )
            if with_argmax:
                chunk_id = ops.argmax(scores, axis=0)
                chunk_id = ops.cast(chunk_id, "int32") + c * chunk
                best_id = ops.where(chunk_max > best, chunk_id, best_id)
            best = ops.maximum(best, chunk_max)
            return new_max, total, best, best_id

        minus_inf = ops.full((positions,), float("-inf"), "float32")
        init = (
            minus_inf,
            ops.zeros((positions,), "float32"),
            minus_inf,
            ops.full((positions,), -1, "int32"),
        )
        running_max, total, best, best_id = ops.fori_loop(0, chunks, body, init)
        normaliser = running_max + ops.log(total)
        signatures = ops.take(table, targets, axis=0)
        target = None
        for i in range(self.num_hashes):
            head = ops.take_along_axis(
                log_probs[:, i, :], signatures[:, i, None], axis=-1
            )[:, 0]
            target = head if target is None else target + head
        if temperature != 1.0:
            target = target / temperature
        return (
            ops.reshape(target - normaliser, batch_shape),
            ops.reshape(best - normaliser, batch_shape),
            ops.reshape(best_id, batch_shape),
        )

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.num_hashes,)

    def compute_output_spec(self, token_ids):
        return keras.KerasTensor(
            self.compute_output_shape(token_ids.shape), dtype="int32"
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "num_hashes": self.num_hashes,
                "num_buckets": self.num_buckets,
                "pad_token_id": self.pad_token_id,
                # The table itself travels in the weights.
                "signatures": None,
            }
        )
        return config


def _chunk_size(positions):
    """Tokens per chunk of `token_statistics`: about 2**22 scores at a time
    (16 MB of float32), a power of two between 256 and 65536."""
    if positions is None:
        return 4096
    chunk = 2 ** max(8, min(16, int(np.log2(max(1, (1 << 22) // positions)))))
    return int(chunk)
