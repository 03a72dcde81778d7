import keras
from keras import ops


def signature_cross_entropy(y_true, y_pred):
    """Per-position loss `sum_i CE(o_i, y_true_i)` (float32), without any
    reduction: int `y_true [..., H]`, float `y_pred [..., H, B]` -> `[...]`.
    Shared by `SignatureCrossEntropy` and the fused training head."""
    logits = ops.cast(y_pred, "float32")
    targets = ops.cast(y_true, "int32")
    # CE = logsumexp(o_i) - o_i[target_i], per head, in float32.
    normalizer = ops.logsumexp(logits, axis=-1)
    target_logits = ops.take_along_axis(logits, targets[..., None], axis=-1)
    per_head = normalizer - target_logits[..., 0]
    return ops.sum(per_head, axis=-1)


@keras.saving.register_keras_serializable(package="keras_mhf")
class SignatureCrossEntropy(keras.losses.Loss):
    """Sum over heads of the bucket cross-entropy (paper Sec. 3.4, training).

    `L = sum_i CE(o_i, bucket_i(next token))` per position, computed in
    float32, then averaged over the unmasked positions: with the default
    reduction `"mean_with_sample_weight"` the sum of weighted per-position
    losses is divided by the sum of `sample_weight` (all positions when no
    weight is given). The vocabulary-sized distribution is never formed.

    Args:
        reduction: a Keras loss reduction. Defaults to
            `"mean_with_sample_weight"`.
        name: the loss name.
        **kwargs: standard `keras.losses.Loss` arguments.

    Call arguments:
        y_true: int `[..., H]`, the target tokens' signatures.
        y_pred: float `[..., H, B]`, the bucket logits.
        sample_weight: optional `[...]` weights (e.g. the padding mask).

    Example:

    ```python
    loss = keras_mhf.losses.SignatureCrossEntropy()
    loss(np.array([[1, 3]]), np.zeros((1, 2, 8)))  # 2 * log(8)
    ```
    """

    def __init__(
        self,
        reduction="mean_with_sample_weight",
        name="signature_cross_entropy",
        **kwargs,
    ):
        super().__init__(reduction=reduction, name=name, **kwargs)

    def call(self, y_true, y_pred):
        return signature_cross_entropy(y_true, y_pred)

    def get_config(self):
        return super().get_config()
