import keras
from keras import ops

from keras_mhf.utils.keras_utils import clone_initializer
from keras_mhf.utils.keras_utils import get_initializer


@keras.saving.register_keras_serializable(package="keras_mhf")
class CascadeHashDecoder(keras.layers.Layer):
    """Cascaded hash decoder tied to the encoder's bucket tables.

    Paper Sec. 3.3. With `c_1 = h_t` (the final-norm hidden state) and the
    tables `E(i)` of `HashEncoder`, for head `i = 1..H`:

    - logits `o_i = c_i E(i)^T` (tied, no bias or scale; "Logit Computation");
    - `p_i = softmax(o_i)` over all B buckets, float32;
    - for `i < H`: `s_i = p_i E(i)` ("Soft Embedding Retrieval") and
      `c_{i+1} = c_i + W_up,i silu(W_dn,i [c_i ; s_i] + b_dn,i) + b_up,i`
      ("State Update via Cascade Mixer"; no norm between heads).

    The layer owns only the `H - 1` mixers; the tables are passed at call
    time (`embeddings`, normally `HashEncoder.embeddings`), so gradients from
    both ends reach the same variables. Leading axes are flattened to one row
    axis before the matmuls: XLA then computes the tables' gradients without
    transposing the `[rows, B]` logit gradients (profiled in
    `tools/profile_step.py`).

    Call arguments:
        hidden_states: float `[..., d]`.
        embeddings: the tied bucket tables: a list of H `[B, d]` tensors or
            variables, or one `[H, B, d]` tensor.

    Returns:
        Bucket logits `[..., H, B]` in the layer's compute dtype.

    Args:
        num_hashes: int, `H`.
        num_buckets: int, `B`.
        hidden_dim: int, `d`.
        mixer_dim: int, `m`, width of each cascade mixer. Defaults to 64.
        kernel_initializer: initializer of the mixer kernels (biases start at
            zero). Defaults to N(0, 0.02).
        **kwargs: standard `keras.layers.Layer` arguments.

    Example:

    ```python
    encoder = keras_mhf.layers.HashEncoder(2, 8, 16)
    decoder = keras_mhf.layers.CascadeHashDecoder(2, 8, 16)
    hidden = encoder(np.array([[[1, 3], [2, 5]]]))
    decoder(hidden, encoder.embeddings)  # [1, 2, 2, 8]
    ```
    """

    def __init__(
        self,
        num_hashes,
        num_buckets,
        hidden_dim,
        mixer_dim=64,
        kernel_initializer="auto",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_hashes = int(num_hashes)
        self.num_buckets = int(num_buckets)
        self.hidden_dim = int(hidden_dim)
        self.mixer_dim = int(mixer_dim)
        self.kernel_initializer = get_initializer(kernel_initializer)

    def build(self, hidden_states_shape=None, embeddings_shape=None):
        self.down_denses = []
        self.up_denses = []
        for i in range(self.num_hashes - 1):
            down = keras.layers.Dense(
                self.mixer_dim,
                activation="silu",
                kernel_initializer=clone_initializer(self.kernel_initializer),
                dtype=self.dtype_policy,
                name=f"mixer_{i}_down_dense",
            )
            down.build((None, 2 * self.hidden_dim))
            up = keras.layers.Dense(
                self.hidden_dim,
                kernel_initializer=clone_initializer(self.kernel_initializer),
                dtype=self.dtype_policy,
                name=f"mixer_{i}_up_dense",
            )
            up.build((None, self.mixer_dim))
            self.down_denses.append(down)
            self.up_denses.append(up)
        self.built = True

    def call(self, hidden_states, embeddings):
        leading_shape = ops.shape(hidden_states)[:-1]
        state = ops.reshape(
            ops.cast(hidden_states, self.compute_dtype), (-1, self.hidden_dim)
        )
        logits = []
        for i in range(self.num_hashes):
            table = ops.cast(embeddings[i], self.compute_dtype)
            # Sec. 3.3 "Logit Computation": o_i = c_i E(i)^T.
            head_logits = ops.matmul(state, ops.transpose(table))
            logits.append(head_logits)
            if i == self.num_hashes - 1:
                break
            # Sec. 3.3 "Soft Embedding Retrieval": s_i = softmax(o_i) E(i).
            probs = ops.softmax(ops.cast(head_logits, "float32"), axis=-1)
            soft = ops.matmul(ops.cast(probs, self.compute_dtype), table)
            # Sec. 3.3 "State Update via Cascade Mixer".
            mixed = self.down_denses[i](ops.concatenate([state, soft], axis=-1))
            state = state + self.up_denses[i](mixed)
        logits = ops.stack(logits, axis=-2)
        return ops.reshape(
            logits, tuple(leading_shape) + (self.num_hashes, self.num_buckets)
        )

    def compute_output_shape(self, hidden_states_shape, embeddings_shape=None):
        return tuple(hidden_states_shape)[:-1] + (self.num_hashes, self.num_buckets)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_hashes": self.num_hashes,
                "num_buckets": self.num_buckets,
                "hidden_dim": self.hidden_dim,
                "mixer_dim": self.mixer_dim,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
            }
        )
        return config
