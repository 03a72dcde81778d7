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
        by `AdamW`).

        The arithmetic is float32 whatever the weights' dtype, and only the
        results are stored in it: in bfloat16, `beta_2 = 0.999` rounds to
        1.0, so `1 - beta_2**t` computed there is 0 (Keras' own `AdamW` then
        makes no update at all, and this step would divide by zero). torch
        computes the corrections in Python floats, so bf16 weights and
        moments train the same way there.
        """
        f32 = "float32"
        lr = ops.cast(learning_rate, f32)
        gradient = ops.cast(gradient, f32)
        step = ops.cast(self.iterations + 1, f32)
        bias_correction_1 = 1 - ops.power(ops.cast(self.beta_1, f32), step)
        bias_correction_2 = 1 - ops.power(ops.cast(self.beta_2, f32), step)
        index = self._get_variable_index(variable)
        m_slot = self._momentums[index]
        v_slot = self._velocities[index]
        m = ops.cast(m_slot, f32)
        v = ops.cast(v_slot, f32)
        m = ops.add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
        v = ops.add(
            v,
            ops.multiply(
                ops.subtract(ops.square(gradient), v), 1 - self.beta_2
            ),
        )
        self.assign(m_slot, ops.cast(m, m_slot.dtype))
        self.assign(v_slot, ops.cast(v, v_slot.dtype))
        if self.amsgrad:
            v_hat = self._velocity_hats[index]
            v = ops.maximum(ops.cast(v_hat, f32), v)
            self.assign(v_hat, ops.cast(v, v_hat.dtype))
        # The correction applied to sqrt(v) before epsilon (torch's order).
        denominator = ops.add(
            ops.divide(ops.sqrt(v), ops.sqrt(bias_correction_2)),
            ops.cast(self.epsilon, f32),
        )
        update = ops.multiply(
            ops.divide(m, denominator), ops.divide(lr, bias_correction_1)
        )
        self.assign(
            variable,
            ops.cast(
                ops.subtract(ops.cast(variable, f32), update), variable.dtype
            ),
        )


def task_default_optimizer(optimizer):
    """What our tasks' `compile(optimizer="auto")` uses: KerasHub's default
    (Adam, learning rate 2e-5, no weight decay) with epsilon after bias
    correction. Any other `optimizer` is returned as given."""
    if isinstance(optimizer, str) and optimizer == "auto":
        return BiasCorrectedAdamW(learning_rate=2e-5, weight_decay=0.0)
    return optimizer
