import keras
from keras import ops

from keras_mhf.layers.hash_encoder import HashEncoder
from keras_mhf.utils.keras_utils import built_dense
from keras_mhf.utils.keras_utils import get_initializer


@keras.saving.register_keras_serializable(package="keras_mhf")
class CascadeHashDecoder(keras.layers.Layer):
    """Cascaded hash decoder tied to a `HashEncoder`'s bucket tables.

    Paper Sec. 3.3. With `c_1 = h_t` (the final-norm hidden state) and the
    tables `E(i)` of the encoder, for head `i = 1..H`:

    - logits `o_i = c_i E(i)^T` (tied, no bias or scale; "Logit Computation");
    - `p_i = softmax(o_i)` over all B buckets, float32;
    - for `i < H`: `s_i = p_i E(i)` ("Soft Embedding Retrieval") and
      `c_{i+1} = c_i + W_up,i silu(W_dn,i [c_i ; s_i] + b_dn,i) + b_up,i`
      ("State Update via Cascade Mixer"; no norm between heads).

    The head is tied through the constructor, as KerasHub's
    `MaskedLMHead(token_embedding=...)`: the decoder owns only the `H - 1`
    mixers and reads the tables through `hash_encoder.bucket_logits` and
    `hash_encoder.soft_embedding`, so gradients from both ends reach the same
    variables. Leading axes are flattened to one row axis before the matmuls:
    XLA then computes the tables' gradients without transposing the
    `[rows, B]` logit gradients (profiled by `benchmarks.profile_step`).

    Call arguments:
        hidden_states: float `[..., d]`.

    Returns:
        Bucket logits `[..., H, B]` in the layer's compute dtype.

    Args:
        hash_encoder: the `HashEncoder` whose tables are tied to the output;
            `H`, `B` and `d` are read from it.
        mixer_dim: int, `m`, width of each cascade mixer. Defaults to 64.
        kernel_initializer: initializer of the mixer kernels (biases start at
            zero). Defaults to N(0, 0.02).
        **kwargs: standard `keras.layers.Layer` arguments.

    Example:

    ```python
    encoder = keras_mhf.layers.HashEncoder(
        num_hashes=2, num_buckets=8, hidden_dim=16
    )
    decoder = keras_mhf.layers.CascadeHashDecoder(encoder, mixer_dim=8)
    hidden = encoder(np.array([[[1, 3], [2, 5]]]))
    decoder(hidden)  # [1, 2, 2, 8]
    ```
    """

    def __init__(
        self,
        hash_encoder,
        mixer_dim=64,
        kernel_initializer="auto",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(hash_encoder, HashEncoder):
            raise ValueError(
                "CascadeHashDecoder is tied to a HashEncoder's tables: pass "
                "`hash_encoder=HashEncoder(...)`; got "
                f"{type(hash_encoder).__name__}."
            )
        self.hash_encoder = hash_encoder
        self.num_hashes = hash_encoder.num_hashes
        self.num_buckets = hash_encoder.num_buckets
        self.hidden_dim = hash_encoder.hidden_dim
        self.mixer_dim = int(mixer_dim)
        self.kernel_initializer = get_initializer(kernel_initializer)

    def build(self, hidden_states_shape=None):
        if not self.hash_encoder.built:
            self.hash_encoder.build()
        self.down_denses = []
        self.up_denses = []
        for i in range(self.num_hashes - 1):
            self.down_denses.append(
                built_dense(
                    self.mixer_dim,
                    2 * self.hidden_dim,
                    f"mixer_{i}_down_dense",
                    self.kernel_initializer,
                    self.dtype_policy,
                    activation="silu",
                )
            )
            self.up_denses.append(
                built_dense(
                    self.hidden_dim,
                    self.mixer_dim,
                    f"mixer_{i}_up_dense",
                    self.kernel_initializer,
                    self.dtype_policy,
                )
            )
        self.built = True

    def head_logits(self, states):
        """The cascade on flat rows: `states [n, d]` -> a list of the `H`
        heads' bucket logits `[n, B]` (compute dtype). `call` stacks them;
        the fused training head (`multi_hash_former_fused_loss`) runs it one
        block of positions at a time."""
        state = ops.cast(states, self.compute_dtype)
        logits = []
        for i in range(self.num_hashes):
            # Sec. 3.3 "Logit Computation": o_i = c_i E(i)^T.
            head_logits = self.hash_encoder.bucket_logits(state, i)
            logits.append(head_logits)
            if i == self.num_hashes - 1:
                break
            # Sec. 3.3 "Soft Embedding Retrieval": s_i = softmax(o_i) E(i).
            probs = ops.softmax(ops.cast(head_logits, "float32"), axis=-1)
            soft = self.hash_encoder.soft_embedding(
                ops.cast(probs, self.compute_dtype), i
            )
            # Sec. 3.3 "State Update via Cascade Mixer".
            mixed = self.down_denses[i](ops.concatenate([state, soft], axis=-1))
            state = state + self.up_denses[i](mixed)
        return logits

    def call(self, hidden_states):
        leading_shape = ops.shape(hidden_states)[:-1]
        state = ops.reshape(hidden_states, (-1, self.hidden_dim))
        logits = ops.stack(self.head_logits(state), axis=-2)
        return ops.reshape(
            logits, tuple(leading_shape) + (self.num_hashes, self.num_buckets)
        )

    def compute_output_shape(self, hidden_states_shape):
        return tuple(hidden_states_shape)[:-1] + (
            self.num_hashes,
            self.num_buckets,
        )

    def compute_output_spec(self, hidden_states):
        return keras.KerasTensor(
            self.compute_output_shape(hidden_states.shape),
            dtype=self.compute_dtype,
        )

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("hash_encoder"), dict):
            config["hash_encoder"] = keras.layers.deserialize(
                config["hash_encoder"]
            )
        return cls(**config)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "hash_encoder": keras.layers.serialize(self.hash_encoder),
                "mixer_dim": self.mixer_dim,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
            }
        )
        return config
