import keras
import numpy as np
from keras import ops

from keras_mhf.signatures.signature_table import SignatureTable
from keras_mhf.signatures.signature_table import check_bucket_ids


@keras.saving.register_keras_serializable(package="keras_mhf")
class SignatureLookup(keras.layers.Layer):
    """Holds the `[V, H]` signature table: token ids -> signatures.

    The table (paper Sec. 3.1, "Multi-Hash Indexing") is a non-trainable int32
    weight, so it is saved and loaded with the model's weights. `call` maps
    token ids `[...]` to signatures `[..., H]`. The way back, from per-head
    bucket log-probs to token scores (Sec. 3.4), is
    `keras_mhf.models.multi_hash_former.multi_hash_former_inference`, which
    reads the table; `table_version` grows whenever the table changes, so
    what inference derives from it (the inverted bucket index) is rebuilt.

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
        check_bucket_ids("The signature table", signatures, self.num_buckets)
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
        self.built = True
        self._initial_signatures = None
        self._table_changed()

    def _table_changed(self):
        # Derived structures (the decoder's inverted bucket index) compare
        # this counter to know when to rebuild.
        self.table_version = getattr(self, "table_version", 0) + 1

    def set_signatures(self, signatures):
        """Replaces the table's values (same `[V, H]` shape)."""
        if not self.built:
            self.build()
        table = self._validate_table(signatures)
        self.signatures.assign(table)
        self._table_changed()

    def get_signatures(self):
        """Returns the table as a numpy int32 array `[V, H]`."""
        if not self.built:
            self.build()
        return np.asarray(ops.convert_to_numpy(self.signatures), "int32")

    def quantize(self, mode=None, type_check=True, config=None):
        """Nothing to quantize: the table holds int bucket ids (this keeps
        `Model.quantize` from warning that the layer cannot be quantized)."""

    def save_own_variables(self, store):
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
