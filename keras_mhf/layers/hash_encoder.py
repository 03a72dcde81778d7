import keras
from keras import ops

from keras_mhf.utils.keras_utils import built_dense
from keras_mhf.utils.keras_utils import get_initializer


@keras.saving.register_keras_serializable(package="keras_mhf")
class HashEncoder(keras.layers.Layer):
    """Hash encoder: H bucket tables and the gated compositional embedding.

    Paper Sec. 3.1 (eq. 2-3). For a token with signature `(b_1, ..., b_H)`:
    `u_i = E(i)[b_i]`; a scorer shared across heads gives
    `a_i = w2 . silu(W1 u_i + b1) + b2`; `alpha = softmax_i(a_i)` (float32);
    the output is `e = Ws (sum_i alpha_i u_i) + bs`. The gate sees only the
    token's own H vectors. The tables `E(i)` (`embeddings`, a list of H
    `[B, d]` variables named `embeddings_<i>`) are also the output tables of
    `CascadeHashDecoder` (weight tying, Sec. 3.3), which reads them through
    `bucket_logits` and `soft_embedding`; bucket 0 is an ordinary
    trainable row. One variable per head, rather than one `[H, B, d]`
    variable, lets compiled code read a head's table in place: XLA copies a
    slice of a stacked table before every matmul that reads it.

    Args:
        num_hashes: int, `H`.
        num_buckets: int, `B` (bucket 0 included).
        hidden_dim: int, `d`.
        gate_dim: int, `g`, width of the gate scorer. Defaults to 64.
        embeddings_initializer: initializer of the tables. Defaults to
            N(0, 0.02).
        kernel_initializer: initializer of the dense kernels (biases start at
            zero). Defaults to N(0, 0.02).
        **kwargs: standard `keras.layers.Layer` arguments.

    Example:

    ```python
    encoder = keras_mhf.layers.HashEncoder(
        num_hashes=2, num_buckets=8, hidden_dim=16
    )
    encoder(np.array([[[1, 3], [2, 5]]]))  # [1, 2, 16]
    ```
    """

    def __init__(
        self,
        num_hashes,
        num_buckets,
        hidden_dim,
        gate_dim=64,
        embeddings_initializer="auto",
        kernel_initializer="auto",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_hashes = int(num_hashes)
        self.num_buckets = int(num_buckets)
        self.hidden_dim = int(hidden_dim)
        self.gate_dim = int(gate_dim)
        self.embeddings_initializer = get_initializer(embeddings_initializer)
        self.kernel_initializer = get_initializer(kernel_initializer)

    def build(self, signatures_shape=None):
        # One draw of shape [H, B, d], split over the heads: the initial
        # values do not depend on how the tables are stored. (Keras drops a
        # variable's initializer once it has run, which frees the draw.)
        initial = []

        def initializer(i):
            def head_initializer(shape, dtype=None):
                if not initial:
                    full_shape = (self.num_hashes,) + tuple(shape)
                    initial.append(
                        self.embeddings_initializer(full_shape, dtype=dtype)
                    )
                return initial[0][i]

            return head_initializer

        self.embeddings = [
            self.add_weight(
                name=f"embeddings_{i}",
                shape=(self.num_buckets, self.hidden_dim),
                initializer=initializer(i),
            )
            for i in range(self.num_hashes)
        ]

        # W1, b1 and the SiLU of the shared scorer (eq. 3).
        self.gate_dense = built_dense(
            self.gate_dim,
            self.hidden_dim,
            "gate_dense",
            self.kernel_initializer,
            self.dtype_policy,
            activation="silu",
        )
        # w2, b2: one score per head.
        self.score_dense = built_dense(
            1,
            self.gate_dim,
            "score_dense",
            self.kernel_initializer,
            self.dtype_policy,
        )
        # Ws, bs: output projection, no activation (eq. 2).
        self.output_dense = built_dense(
            self.hidden_dim,
            self.hidden_dim,
            "output_dense",
            self.kernel_initializer,
            self.dtype_policy,
        )
        self.built = True

    def lookup(self, signatures):
        """Signatures `[..., H]` -> the H bucket vectors `[..., H, d]`."""
        signatures = ops.cast(signatures, "int32")
        vectors = [
            ops.take(table, signatures[..., i], axis=0)
            for i, table in enumerate(self.embeddings)
        ]
        return ops.stack(vectors, axis=-2)

    def bucket_logits(self, states, head):
        """`states [n, d]` -> head `head`'s bucket logits `states E(head)^T`
        `[n, B]`, in the dtype of `states` (the tied output tables of
        `CascadeHashDecoder`, paper Sec. 3.3 "Logit Computation")."""
        table = ops.cast(self.embeddings[head], states.dtype)
        return ops.matmul(states, ops.transpose(table))

    def soft_embedding(self, probs, head):
        """`probs [n, B]` over head `head`'s buckets -> the expected bucket
        vector `probs E(head)` `[n, d]` (paper Sec. 3.3 "Soft Embedding
        Retrieval")."""
        table = ops.cast(self.embeddings[head], probs.dtype)
        return ops.matmul(probs, table)

    def stacked_embeddings(self):
        """The H tables as one `[H, B, d]` tensor (a copy)."""
        return ops.stack([table.value for table in self.embeddings], axis=0)

    def call(self, signatures):
        # Sec. 3.1 eq. 2: u_i = E(i)[bucket_i].
        vectors = self.lookup(signatures)
        # Sec. 3.1 eq. 3: alpha = softmax over heads of the shared scorer.
        scores = self.score_dense(self.gate_dense(vectors))[..., 0]
        alpha = ops.softmax(ops.cast(scores, "float32"), axis=-1)
        alpha = ops.cast(alpha, vectors.dtype)
        mixed = ops.sum(vectors * alpha[..., None], axis=-2)
        # Sec. 3.1 eq. 2: e = Ws (sum_i alpha_i u_i) + bs.
        return self.output_dense(mixed)

    def compute_output_shape(self, signatures_shape):
        return tuple(signatures_shape)[:-1] + (self.hidden_dim,)

    def compute_output_spec(self, signatures):
        return keras.KerasTensor(
            self.compute_output_shape(signatures.shape),
            dtype=self.compute_dtype,
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_hashes": self.num_hashes,
                "num_buckets": self.num_buckets,
                "hidden_dim": self.hidden_dim,
                "gate_dim": self.gate_dim,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
            }
        )
        return config
