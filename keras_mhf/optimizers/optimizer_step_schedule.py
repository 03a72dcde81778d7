import keras


@keras.saving.register_keras_serializable(package="keras_mhf")
class OptimizerStepSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule read at the optimizer step when gradients
    are accumulated.

    With `gradient_accumulation_steps=N`, a Keras optimizer counts every
    micro-batch in `optimizer._iterations` and evaluates a schedule at that
    count, so a schedule of optimizer steps would run `N` times too fast
    (its warmup over `warmup / N` steps). This wrapper evaluates `schedule`
    at `micro_step // N`: the optimizer step, as `optimizer.iterations`
    counts it and as the authors' Trainer (`gradient_accumulation_steps`)
    steps its scheduler. The update of step `k` (0-based), applied at micro
    step `k * N + N - 1`, uses `schedule(k)`, as without accumulation.

    Args:
        schedule: a `LearningRateSchedule` over optimizer steps.
        gradient_accumulation_steps: micro-batches per optimizer step (>= 1).

    Example:

    ```python
    cosine = keras.optimizers.schedules.CosineDecay(0.0, 1000, warmup_target=1e-3,
                                                    warmup_steps=100)
    optimizer = keras.optimizers.AdamW(
        learning_rate=OptimizerStepSchedule(cosine, 8),
        gradient_accumulation_steps=8,
    )
    ```
    """

    def __init__(self, schedule, gradient_accumulation_steps):
        if (
            isinstance(gradient_accumulation_steps, bool)
            or not isinstance(gradient_accumulation_steps, int)
            or gradient_accumulation_steps < 1
        ):
            raise ValueError(
                "gradient_accumulation_steps must be an integer >= 1, got "
                f"{gradient_accumulation_steps!r}."
            )
        self.schedule = schedule
        self.gradient_accumulation_steps = gradient_accumulation_steps

    def __call__(self, step):
        return self.schedule(
            keras.ops.floor_divide(step, self.gradient_accumulation_steps)
        )

    def get_config(self):
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(
            config["schedule"]
        )
        return cls(**config)
