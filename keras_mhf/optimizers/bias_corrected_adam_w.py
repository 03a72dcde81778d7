import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_mhf")
class BiasCorrectedAdamW(keras.optimizers.AdamW):
    """AdamW as `torch.optim.AdamW` (and so the authors' runs) computes it:
    epsilon is added to the bias-corrected `sqrt(v_hat)`.

    Keras' `Adam`/`AdamW` add epsilon to the uncorrected `sqrt(v)` and fold
    the bias correction into the step size, which behaves like torch with
    epsilon `eps / sqrt(1 - beta_2**t)`: 22x larger at step 2, 2x at step
    300. That damps parameters whose gradients are small after clipping
    (most of the gate scorer's, early in training). This class changes only
    where epsilon goes; every argument, the decoupled weight decay
    (`w -= lr * weight_decay * w` before the update, as torch), clipping,
    schedules and the saved state are Keras `AdamW`'s. At step `t`:

        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g**2
        w -= lr / (1 - beta_1**t) * m / (sqrt(v) / sqrt(1 - beta_2**t) + eps)

    Keras' own placement stays available as `keras.optimizers.AdamW`
    (`make_optimizer(..., name="keras_adamw")`, `--optimizer keras_adamw`).

    Args:
        **kwargs: the arguments of `keras.optimizers.AdamW` (defaults as
            there; the recipes use `weight_decay=0.1`, `epsilon=1e-8`).

    Example:

    ```python
    optimizer = BiasCorrectedAdamW(learning_rate=1e-3, weight_decay=0.1)
    lm.compile(optimizer=optimizer)
    ```
    """

    def update_step(self, gradient, variable, learning_rate):
        """One Adam step of `variable` (weight decay is applied before it,
        by `AdamW`)."""
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        step = ops.cast(self.iterations + 1, dtype)
        bias_correction_1 = 1 - ops.power(ops.cast(self.beta_1, dtype), step)
        bias_correction_2 = 1 - ops.power(ops.cast(self.beta_2, dtype), step)
        index = self._get_variable_index(variable)
        m = self._momentums[index]
        v = self._velocities[index]
        self.assign_add(
            m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1)
        )
        self.assign_add(
            v,
            ops.multiply(
                ops.subtract(ops.square(gradient), v), 1 - self.beta_2
            ),
        )
        if self.amsgrad:
            v_hat = self._velocity_hats[index]
            self.assign(v_hat, ops.maximum(v_hat, v))
            v = v_hat
        # The correction applied to sqrt(v) before epsilon (torch's order).
        denominator = ops.add(
            ops.divide(ops.sqrt(v), ops.sqrt(bias_correction_2)),
            ops.cast(self.epsilon, dtype),
        )
        self.assign_sub(
            variable,
            ops.multiply(
                ops.divide(m, denominator), ops.divide(lr, bias_correction_1)
            ),
        )


def task_default_optimizer(optimizer):
    """What our tasks' `compile(optimizer="auto")` uses: KerasHub's default
    (Adam, learning rate 2e-5, no weight decay) with epsilon after bias
    correction. Any other `optimizer` is returned as given."""
    if isinstance(optimizer, str) and optimizer == "auto":
        return BiasCorrectedAdamW(learning_rate=2e-5, weight_decay=0.0)
    return optimizer
