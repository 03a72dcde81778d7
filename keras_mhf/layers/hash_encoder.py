import keras
import numpy as np
from keras import ops

from keras_mhf.utils.keras_utils import built_dense
from keras_mhf.utils.keras_utils import get_initializer

# Quantized tables are read in chunks of this many rows (buckets), cast to
# float a chunk at a time: a float copy of a whole table never exists.
TABLE_CHUNK = 2048
TABLE_QUANTIZATION_MODES = ("int8", "int4")


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
        if self.quantization_mode is not None:
            # Rebuilt from the config of a quantized model: int tables.
            self.quantized_build(None, self.quantization_mode)
        else:
            self._float_build()
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

    def _float_build(self):
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

    # --- Quantization (int8 / int4 tables, per-row scales) ---------------

    def _chunk(self):
        """Rows read at a time from a quantized table."""
        return min(TABLE_CHUNK, self.num_buckets)

    def _padded_buckets(self):
        """Rows of a quantized table: `B` rounded up to whole chunks."""
        chunk = self._chunk()
        return -(-self.num_buckets // chunk) * chunk

    def quantized_build(self, input_shape, mode, config=None):
        if mode not in TABLE_QUANTIZATION_MODES:
            raise self._quantization_mode_error(mode)
        rows = self._padded_buckets()
        width = self.hidden_dim
        if mode == "int4":  # two int4 values per int8 byte along d
            width = (self.hidden_dim + 1) // 2
        self.embeddings = [
            self.add_weight(
                name=f"embeddings_{i}",
                shape=(rows, width),
                initializer="zeros",
                dtype="int8",
                trainable=False,
            )
            for i in range(self.num_hashes)
        ]
        self.embeddings_scale = [
            self.add_weight(
                name=f"embeddings_scale_{i}",
                shape=(rows,),
                initializer="ones",
                trainable=False,
            )
            for i in range(self.num_hashes)
        ]
        self._is_quantized = True

    def quantize(self, mode=None, type_check=True, config=None):
        """Quantizes the H bucket tables to int8 (or int4), one scale per row
        (bucket), as Keras' `Embedding` does; the gate and projection
        `Dense` layers are quantized by Keras itself (`Model.quantize`
        reaches them). The tables serve the encoder's lookup and the tied
        decoder's logits and soft retrieval, which read them chunk by chunk
        (`TABLE_CHUNK` rows) in the int dtype, never as a float copy."""
        if mode not in TABLE_QUANTIZATION_MODES:
            raise NotImplementedError(
                f"HashEncoder tables support quantization modes "
                f"{TABLE_QUANTIZATION_MODES}; got {mode!r}."
            )
        self._check_quantize_args(mode, self.compute_dtype)
        high = 127 if mode == "int8" else 7
        rows = self._padded_buckets()
        values, scales = [], []
        for table in self.embeddings:
            table = np.asarray(ops.convert_to_numpy(table), "float32")
            peak = np.maximum(np.abs(table).max(axis=-1), 1e-7)
            scale = (high / peak).astype("float32")
            value = np.clip(np.round(table * scale[:, None]), -high, high)
            value = value.astype("int8")
            padding = rows - self.num_buckets
            value = np.pad(value, [[0, padding], [0, 0]])
            scale = np.pad(scale, [0, padding], constant_values=1.0)
            if mode == "int4":
                value, _, _ = keras.quantizers.pack_int4(value, axis=-1)
                value = np.asarray(ops.convert_to_numpy(value))
            values.append(value)
            scales.append(scale)
        for table in self.embeddings:
            self._untrack_variable(table)
        del self.embeddings
        self.quantized_build(None, mode, config)
        for variable, value in zip(self.embeddings, values):
            variable.assign(value)
        for variable, scale in zip(self.embeddings_scale, scales):
            variable.assign(scale)
        if self.dtype_policy.quantization_mode is None:
            self.dtype_policy = keras.dtype_policies.get(
                f"{mode}_from_{self.dtype_policy.name}"
            )

    def quantized_call(self, *args, **kwargs):
        # `call` reads the tables through `lookup`, which handles both.
        return self.call(*args, **kwargs)

    def _table_rows(self, table, start, count):
        """Rows `[start, start + count)` of a quantized table tensor as int8
        `[count, d]` (unpacked for int4; the caller applies the scales)."""
        rows = ops.slice(table, [start, 0], [count, ops.shape(table)[1]])
        if self.quantization_mode == "int4":
            rows = keras.quantizers.unpack_int4(rows, self.hidden_dim, axis=-1)
        return rows

    def lookup(self, signatures):
        """Signatures `[..., H]` -> the H bucket vectors `[..., H, d]`."""
        signatures = ops.cast(signatures, "int32")
        vectors = []
        for i, table in enumerate(self.embeddings):
            rows = ops.take(table, signatures[..., i], axis=0)
            if self.quantization_mode is not None:
                if self.quantization_mode == "int4":
                    rows = keras.quantizers.unpack_int4(
                        rows, self.hidden_dim, axis=-1
                    )
                scale = ops.take(self.embeddings_scale[i], signatures[..., i])
                rows = ops.cast(rows, self.compute_dtype) / ops.cast(
                    scale[..., None], self.compute_dtype
                )
            vectors.append(rows)
        return ops.stack(vectors, axis=-2)

    def bucket_logits(self, states, head):
        """`states [n, d]` -> head `head`'s bucket logits `states E(head)^T`
        `[n, B]`, in the dtype of `states` (the tied output tables of
        `CascadeHashDecoder`, paper Sec. 3.3 "Logit Computation")."""
        if self.quantization_mode is None:
            table = ops.cast(self.embeddings[head], states.dtype)
            return ops.matmul(states, ops.transpose(table))
        chunks = self._padded_buckets() // self._chunk()
        logits = ops.zeros(
            (ops.shape(states)[0], self._padded_buckets()), states.dtype
        )
        table = ops.convert_to_tensor(self.embeddings[head])
        all_scales = ops.cast(self.embeddings_scale[head], states.dtype)

        def body(c, logits):
            start = c * self._chunk()
            rows = ops.cast(
                self._table_rows(table, start, self._chunk()), states.dtype
            )
            scales = ops.slice(all_scales, [start], [self._chunk()])
            part = ops.matmul(states, ops.transpose(rows)) / scales[None, :]
            return ops.slice_update(logits, [0, start], part)

        logits = ops.fori_loop(0, chunks, body, logits)
        return logits[:, : self.num_buckets]

    def soft_embedding(self, probs, head):
        """`probs [n, B]` over head `head`'s buckets -> the expected bucket
        vector `probs E(head)` `[n, d]` (paper Sec. 3.3 "Soft Embedding
        Retrieval")."""
        if self.quantization_mode is None:
            table = ops.cast(self.embeddings[head], probs.dtype)
            return ops.matmul(probs, table)
        padding = self._padded_buckets() - self.num_buckets
        probs = ops.pad(probs, [[0, 0], [0, padding]])
        chunks = self._padded_buckets() // self._chunk()
        total = ops.zeros((ops.shape(probs)[0], self.hidden_dim), probs.dtype)
        table = ops.convert_to_tensor(self.embeddings[head])
        all_scales = ops.cast(self.embeddings_scale[head], probs.dtype)

        def body(c, total):
            start = c * self._chunk()
            rows = ops.cast(
                self._table_rows(table, start, self._chunk()), probs.dtype
            )
            scales = ops.slice(all_scales, [start], [self._chunk()])
            weights = ops.slice(
                probs, [0, start], [ops.shape(probs)[0], self._chunk()]
            )
            return total + ops.matmul(weights / scales[None, :], rows)

        return ops.fori_loop(0, chunks, body, total)

    def stacked_embeddings(self):
        """The H tables as one float `[H, B, d]` tensor (a copy; dequantized
        when the tables are quantized)."""
        if self.quantization_mode is None:
            return ops.stack([table.value for table in self.embeddings], axis=0)
        tables = []
        for i in range(self.num_hashes):
            table = ops.convert_to_tensor(self.embeddings[i])
            rows = self._table_rows(table, 0, self.num_buckets)
            scales = ops.convert_to_tensor(self.embeddings_scale[i])
            scales = scales[: self.num_buckets]
            tables.append(ops.cast(rows, "float32") / scales[:, None])
        return ops.stack(tables, axis=0)

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
