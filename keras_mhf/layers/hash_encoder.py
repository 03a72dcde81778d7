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

    # --- Quantization (int8 / int4 tables, per-row or per-group scales) ----

    def _chunk(self):
        """Rows read at a time from a quantized table."""
        return min(TABLE_CHUNK, self.num_buckets)

    def _padded_buckets(self):
        """Rows of a quantized table: `B` rounded up to whole chunks."""
        chunk = self._chunk()
        return -(-self.num_buckets // chunk) * chunk

    def _int4_block_size(self, config=None):
        """The int4 group size along `d` (`None`: one scale per row), from
        `config` (an `Int4QuantizationConfig`) or, for a layer rebuilt from
        a saved model, from its dtype policy (`"int4/<block>_from_..."`),
        as `keras.layers.Embedding` decides it."""
        if config is not None:
            block_size = getattr(config, "block_size", None)
        else:
            policy = self.dtype_policy
            if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
                policy = policy[self.path]
            block_size = getattr(policy, "block_size", None)
        return None if block_size in (None, -1) else int(block_size)

    def quantized_build(self, input_shape, mode, config=None):
        if mode not in TABLE_QUANTIZATION_MODES:
            raise self._quantization_mode_error(mode)
        rows = self._padded_buckets()
        width = self.hidden_dim
        if mode == "int4":  # two int4 values per int8 byte along d
            width = (self.hidden_dim + 1) // 2
        self._block_size = None
        if mode == "int4":
            self._block_size = self._int4_block_size(config)
        scale_shape = (rows,)
        if self._block_size is not None:
            scale_shape = (rows, -(-self.hidden_dim // self._block_size))

        def weights(name, shape, initializer, dtype=None):
            return [
                self.add_weight(
                    name=f"{name}_{i}",
                    shape=shape,
                    initializer=initializer,
                    dtype=dtype,
                    trainable=False,
                )
                for i in range(self.num_hashes)
            ]

        self.embeddings = weights("embeddings", (rows, width), "zeros", "int8")
        self.embeddings_scale = weights("embeddings_scale", scale_shape, "ones")
        if self._block_size is not None:  # asymmetric: zero points too
            self.embeddings_zero = weights(
                "embeddings_zero", scale_shape, "zeros", "int8"
            )
        # What the tables' matmuls do to their float operand, as Keras'
        # Dense and tied ReversibleEmbedding: int8 quantizes it per row
        # (abs-max) by default, int4 keeps it float.
        self.inputs_quantizer = (
            keras.quantizers.QuantizationConfig.activation_quantizer_or_default(
                config, _default_inputs_quantizer(mode)
            )
        )
        self._is_quantized = True

    def quantize(self, mode=None, type_check=True, config=None):
        """Quantizes the H bucket tables to int8 (or int4) with Keras'
        quantizers, as `keras.layers.Embedding` quantizes its table: one
        abs-max scale per row (bucket) from `keras.quantizers.AbsMaxQuantizer`
        (or the config's `weight_quantizer`), or, for int4 with a
        `block_size` (`Int4QuantizationConfig`'s default is 128),
        asymmetric groups along `d` with zero points
        (`keras.quantizers.abs_max_quantize_grouped_with_zero_point`). The
        gate and projection `Dense` layers are quantized by Keras itself
        (`Model.quantize` reaches them). The tables serve the encoder's
        lookup and the tied decoder's logits and soft retrieval, which read
        them chunk by chunk (`TABLE_CHUNK` rows), never as a float copy of
        a table; as in Keras' tied `ReversibleEmbedding`, int8 also
        quantizes the float operand of those matmuls per row
        (`inputs_quantizer`) for an int matmul.

        Args:
            mode: `"int8"` or `"int4"`.
            type_check: unused (the tables are this layer's own weights).
            config: `None`, or a `keras.quantizers.Int8QuantizationConfig` /
                `Int4QuantizationConfig` of `mode` (Keras passes the mode's
                default config when none is given). Its `weight_quantizer`
                must give one scale per row and its `activation_quantizer`
                must be the mode's default (see
                `check_table_quantization_config`); anything else is
                refused with a `ValueError`, never ignored.
        """
        del type_check
        if mode not in TABLE_QUANTIZATION_MODES:
            raise NotImplementedError(
                f"HashEncoder tables support quantization modes "
                f"{TABLE_QUANTIZATION_MODES}; got {mode!r}."
            )
        check_table_quantization_config(mode, config)
        self._check_quantize_args(mode, self.compute_dtype)
        block_size = self._int4_block_size(config) if mode == "int4" else None
        padding = self._padded_buckets() - self.num_buckets
        quantized = []
        for table in self.embeddings:
            parts = _quantize_table(table, mode, config, block_size)
            # Padding rows: zero values, unit scales, zero zero-points.
            fill = (0, 1, 0)[: len(parts)]
            parts = [_pad_rows(p, padding, v) for p, v in zip(parts, fill)]
            if mode == "int4":
                parts[0], _, _ = keras.quantizers.pack_int4(parts[0], axis=-1)
            quantized.append(parts)
        for table in self.embeddings:
            self._untrack_variable(table)
        del self.embeddings
        self.quantized_build(None, mode, config)
        groups = [self.embeddings, self.embeddings_scale]
        if block_size is not None:
            groups.append(self.embeddings_zero)
        for i, parts in enumerate(quantized):
            for variables, part in zip(groups, parts):
                variables[i].assign(part)
        if self.dtype_policy.quantization_mode is None:
            name = mode if block_size is None else f"int4/{block_size}"
            self.dtype_policy = keras.dtype_policies.get(
                f"{name}_from_{self.dtype_policy.name}"
            )

    def quantized_call(self, *args, **kwargs):
        # `call` reads the tables through `lookup`, which handles both.
        return self.call(*args, **kwargs)

    def _dequantized(self, head, values, index, dtype):
        """Int rows `values [..., d]` of quantized table `head` (unpacked),
        at bucket ids `index` (an int tensor, or `(start, count)` for a
        slice) -> `(rows, divisor)`: the float rows are
        `rows / divisor[..., None]` (per-row scales: the int values cast,
        divided later, once per output) or `rows` itself (grouped int4:
        dequantized here; `divisor` is `None`)."""

        def rows_of(variable):
            variable = ops.convert_to_tensor(variable)
            if isinstance(index, tuple):
                start, count = index
                shape = [count] + list(ops.shape(variable)[1:])
                begin = [start] + [0] * (len(ops.shape(variable)) - 1)
                return ops.slice(variable, begin, shape)
            return ops.take(variable, index, axis=0)

        values = ops.cast(values, dtype)
        scale = ops.cast(rows_of(self.embeddings_scale[head]), dtype)
        if getattr(self, "_block_size", None) is None:
            return values, scale
        # Asymmetric groups along d (Keras' `dequantize_with_sz_map`, which
        # is not public): (q - zero[group]) * scale[group].
        groups = ops.arange(self.hidden_dim) // self._block_size
        zero = ops.cast(rows_of(self.embeddings_zero[head]), dtype)
        rows = (values - ops.take(zero, groups, axis=-1)) * ops.take(
            scale, groups, axis=-1
        )
        return rows, None

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
                rows, divisor = self._dequantized(
                    i, rows, signatures[..., i], self.compute_dtype
                )
                if divisor is not None:
                    rows = rows / divisor[..., None]
            vectors.append(rows)
        return ops.stack(vectors, axis=-2)

    def _chunked_table_matmul(self, x, head, transposed):
        """`x @ E(head)^T` (`transposed`; `x [n, d]` -> `[n, B]`) or
        `x @ E(head)` (`x [n, B]` -> `[n, d]`) on a quantized table, read
        `TABLE_CHUNK` rows at a time in a `fori_loop`, so that at most one
        chunk is ever cast to float. Per-row scales divide the `[n, B]` side
        (no float copy of a row); `inputs_quantizer`, when set, quantizes
        `x` (per row, as `Dense` quantizes its inputs) for an int matmul."""
        chunk, rows = self._chunk(), self._padded_buckets()
        n, dtype = ops.shape(x)[0], x.dtype
        grouped = getattr(self, "_block_size", None) is not None
        scales = ops.cast(self.embeddings_scale[head], dtype)  # [B] or [B, G]
        if transposed:
            total = ops.zeros((n, rows), dtype)
        else:
            total = ops.zeros((n, self.hidden_dim), dtype)
            x = ops.pad(x, [[0, 0], [0, rows - self.num_buckets]])
            if not grouped:  # `x / scales` weighs the int rows
                x = x / scales[None, :]
        x_scale = None
        if self.inputs_quantizer is not None:
            x, x_scale = self.inputs_quantizer(x)
            if grouped:  # the rows are dequantized floats
                x = ops.cast(x, dtype)
        table = ops.convert_to_tensor(self.embeddings[head])

        def body(c, total):
            start = c * chunk
            values = self._table_rows(table, start, chunk)
            if grouped:
                values, _ = self._dequantized(
                    head, values, (start, chunk), dtype
                )
            elif x_scale is None:  # else an int matmul
                values = ops.cast(values, dtype)
            if not transposed:
                weights = ops.slice(x, [0, start], [n, chunk])
                return total + ops.cast(ops.matmul(weights, values), dtype)
            part = ops.cast(ops.matmul(x, ops.transpose(values)), dtype)
            if not grouped:
                part = part / ops.slice(scales, [start], [chunk])[None, :]
            return ops.slice_update(total, [0, start], part)

        total = ops.fori_loop(0, rows // chunk, body, total)
        if x_scale is not None:
            total = total / ops.cast(x_scale, dtype)
        return total[:, : self.num_buckets] if transposed else total

    def bucket_logits(self, states, head):
        """`states [n, d]` -> head `head`'s bucket logits `states E(head)^T`
        `[n, B]`, in the dtype of `states` (the tied output tables of
        `CascadeHashDecoder`, paper Sec. 3.3 "Logit Computation")."""
        if self.quantization_mode is None:
            table = ops.cast(self.embeddings[head], states.dtype)
            return ops.matmul(states, ops.transpose(table))
        return self._chunked_table_matmul(states, head, transposed=True)

    def soft_embedding(self, probs, head):
        """`probs [n, B]` over head `head`'s buckets -> the expected bucket
        vector `probs E(head)` `[n, d]` (paper Sec. 3.3 "Soft Embedding
        Retrieval")."""
        if self.quantization_mode is None:
            table = ops.cast(self.embeddings[head], probs.dtype)
            return ops.matmul(probs, table)
        return self._chunked_table_matmul(probs, head, transposed=False)

    def stacked_embeddings(self):
        """The H tables as one float `[H, B, d]` tensor (a copy; dequantized
        when the tables are quantized)."""
        if self.quantization_mode is None:
            return ops.stack([table.value for table in self.embeddings], axis=0)
        tables = []
        for i in range(self.num_hashes):
            table = ops.convert_to_tensor(self.embeddings[i])
            rows = self._table_rows(table, 0, self.num_buckets)
            rows, divisor = self._dequantized(
                i, rows, (0, self.num_buckets), "float32"
            )
            if divisor is not None:
                rows = rows / divisor[:, None]
            tables.append(rows)
        return ops.stack(tables, axis=0)

    def call(self, signatures):
        # Sec. 3.1 eq. 2: u_i = E(i)[bucket_i].
        vectors = self.lookup(signatures)
        # Sec. 3.1 eq. 3: alpha = softmax over heads of the shared scorer.
        scores = self.score_dense(self.gate_dense(vectors))[..., 0]
        alpha = ops.softmax(ops.cast(scores, "float32"), axis=-1)
        alpha = ops.cast(alpha, vectors.dtype)
        # (`expand_dims`, not `[..., None]`: a LiteRT builtin, no Flex op.)
        mixed = ops.sum(vectors * ops.expand_dims(alpha, -1), axis=-2)
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


def _default_inputs_quantizer(mode):
    """What the tables' matmuls do to their float operand when no config
    says otherwise (a layer rebuilt from a saved model): Keras' defaults,
    as `Dense` and the tied `ReversibleEmbedding` (int8: per-row abs-max
    int8; int4: none)."""
    if mode == "int8":
        return keras.quantizers.AbsMaxQuantizer(axis=-1)
    return None


def _is_default_inputs_quantizer(mode, quantizer):
    default = _default_inputs_quantizer(mode)
    if quantizer is None or default is None:
        return quantizer is default
    if type(quantizer) is not type(default):
        return False
    config = dict(quantizer.get_config())
    if tuple(config.pop("axis", (-1,))) not in ((-1,), (1,)):
        return False
    expected = dict(default.get_config())
    expected.pop("axis")
    config["value_range"] = tuple(config["value_range"])
    expected["value_range"] = tuple(expected["value_range"])
    return config == expected


def check_table_quantization_config(mode, config):
    """Raises a clear `ValueError` unless the bucket tables can honour
    `config` for `mode` (`"int8"` / `"int4"`) exactly, in this process and
    in a model reloaded from disk: `None`, or a
    `keras.quantizers.Int8QuantizationConfig` / `Int4QuantizationConfig` of
    that mode whose `activation_quantizer` is the mode's default (int8:
    `AbsMaxQuantizer()` per row; int4: `None`), since a saved model records
    the quantized weights and the mode (and int4 `block_size`) but not an
    activation quantizer. Any per-row `weight_quantizer` and any int4
    `block_size` are honoured. `HashEncoder.quantize` calls it, and so does
    the models' `quantize`, before any layer changes."""
    if config is None:
        return
    expected = {
        "int8": keras.quantizers.Int8QuantizationConfig,
        "int4": keras.quantizers.Int4QuantizationConfig,
    }[mode]
    if not isinstance(config, expected):
        raise ValueError(
            f"HashEncoder tables quantized to {mode!r} take `config=None` or "
            f"a `keras.quantizers.{expected.__name__}`; got "
            f"{type(config).__name__}."
        )
    weight_quantizer = config.weight_quantizer
    axis = getattr(weight_quantizer, "axis", None)
    if axis is not None and tuple(axis) not in ((-1,), (1,)):
        raise ValueError(
            "HashEncoder's bucket tables need one scale per row (bucket): "
            f"the config's weight quantizer reduces over axis={axis}; use "
            "axis=-1 (or None). (Keras' Dense layers reduce their kernels "
            "over axis 0 by default: leave `weight_quantizer=None` to give "
            "each layer its own default.)"
        )
    if not _is_default_inputs_quantizer(mode, config.activation_quantizer):
        default = "AbsMaxQuantizer()" if mode == "int8" else "None"
        raise ValueError(
            f"HashEncoder's bucket tables take {mode!r} configs with the "
            f"default activation quantizer ({default}); got "
            f"activation_quantizer={config.activation_quantizer!r}. A saved "
            "model records the quantized tables but not their activation "
            "quantizer, so a reloaded model would compute differently "
            "(Keras' own Dense layers inside a KerasHub backbone have the "
            "same limit). Leave `activation_quantizer` at its default."
        )


def _quantize_table(table, mode, config, block_size):
    """One `[B, d]` table -> numpy `(values, scales)` with one scale per row
    (`keras.quantizers.AbsMaxQuantizer`, or the config's weight quantizer),
    or `(values, scales [B, G], zero points [B, G])` for grouped int4
    (`keras.quantizers.abs_max_quantize_grouped_with_zero_point` along `d`,
    as `keras.layers.Embedding`)."""
    if block_size is not None:
        values, scales, zeros = (
            keras.quantizers.abs_max_quantize_grouped_with_zero_point(
                ops.transpose(table),
                block_size=block_size,
                value_range=(-8, 7),
                dtype="int8",
                to_numpy=True,
            )
        )
        return [
            np.asarray(ops.convert_to_numpy(x)).T
            for x in (values, scales, zeros)
        ]
    value_range = (-127, 127) if mode == "int8" else (-8, 7)
    default = keras.quantizers.AbsMaxQuantizer(
        axis=-1, value_range=value_range, output_dtype="int8"
    )
    quantizer = default
    if config is not None and config.weight_quantizer is not None:
        quantizer = config.weight_quantizer
    values, scales = quantizer(table, to_numpy=True)
    values = np.asarray(ops.convert_to_numpy(values))
    scales = np.asarray(ops.convert_to_numpy(scales), "float32")
    rows = table.shape[0]
    if values.shape != tuple(table.shape) or scales.shape not in (
        (rows,),
        (rows, 1),
    ):
        raise ValueError(
            "HashEncoder tables need one scale per row (bucket): the "
            f"weight quantizer {quantizer!r} gave values of shape "
            f"{values.shape} and scales of shape {scales.shape} for a table "
            f"of shape {tuple(table.shape)}. Use an `AbsMaxQuantizer` with "
            "`axis=-1` (the default)."
        )
    return [values.astype("int8"), scales.reshape(rows)]


def _pad_rows(array, padding, value):
    """`array` with `padding` more rows of `value` (whole chunks)."""
    array = np.asarray(ops.convert_to_numpy(array))
    widths = [[0, padding]] + [[0, 0]] * (array.ndim - 1)
    return np.pad(array, widths, constant_values=value)
