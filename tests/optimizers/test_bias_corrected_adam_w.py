"""`BiasCorrectedAdamW` against `torch.optim.AdamW` (the authors' optimizer),
on every backend: the same weights after several steps, also where the
gradients are far below epsilon (where Keras' own AdamW differs)."""

import keras
import numpy as np
import pytest
import torch

from keras_mhf.optimizers import BiasCorrectedAdamW

STEPS = 6
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.1


def weights_and_gradients(seed=0):
    rng = np.random.default_rng(seed)
    weights = [
        rng.normal(size=(5, 4)).astype("float32"),
        rng.normal(size=(7,)).astype("float32"),
    ]
    gradients = []
    for step in range(STEPS):
        big = rng.normal(size=(5, 4)).astype("float32")
        # Gradients of 1e-12 .. 1e-9: far below epsilon (1e-8), like most
        # of the gate scorer's after clipping.
        tiny = (rng.normal(size=(7,)) * 10.0 ** -rng.integers(9, 13)).astype(
            "float32"
        )
        gradients.append([big, tiny])
    return weights, gradients


def torch_adamw(weights, gradients):
    params = [torch.nn.Parameter(torch.tensor(w)) for w in weights]
    optimizer = torch.optim.AdamW(
        params,
        lr=LEARNING_RATE,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=WEIGHT_DECAY,
    )
    for step_gradients in gradients:
        for param, gradient in zip(params, step_gradients):
            param.grad = torch.tensor(gradient)
        optimizer.step()
    return [p.detach().numpy() for p in params]


def keras_steps(optimizer, weights, gradients):
    variables = [keras.Variable(w) for w in weights]
    optimizer.build(variables)
    for step_gradients in gradients:
        optimizer.apply(
            [keras.ops.convert_to_tensor(g) for g in step_gradients],
            variables,
        )
    return [keras.ops.convert_to_numpy(v) for v in variables]


def test_the_same_steps_as_torch_adamw():
    weights, gradients = weights_and_gradients()
    expected = torch_adamw(weights, gradients)
    ours = keras_steps(
        BiasCorrectedAdamW(
            learning_rate=LEARNING_RATE,
            weight_decay=WEIGHT_DECAY,
            epsilon=1e-8,
        ),
        weights,
        gradients,
    )
    keras_own = keras_steps(
        keras.optimizers.AdamW(
            learning_rate=LEARNING_RATE,
            weight_decay=WEIGHT_DECAY,
            epsilon=1e-8,
        ),
        weights,
        gradients,
    )
    for ours_w, torch_w, start in zip(ours, expected, weights):
        # float32 round-off: a few units in the last place of the weights.
        ulp = np.spacing(np.max(np.abs(start)))
        np.testing.assert_allclose(ours_w, torch_w, rtol=0, atol=4 * ulp)
        # ... which is small against the update itself.
        update = np.abs(torch_w - start)
        assert np.max(np.abs(ours_w - torch_w)) < 1e-3 * np.max(update)
    # Keras' placement of epsilon damps the tiny-gradient weights' updates
    # (the second variable): the test tells the two apart.
    tiny_update_ours = np.abs(ours[1] - weights[1] * (1 - 1e-4) ** STEPS)
    tiny_update_keras = np.abs(keras_own[1] - weights[1] * (1 - 1e-4) ** STEPS)
    assert np.median(tiny_update_keras) < 0.5 * np.median(tiny_update_ours)


def test_a_restored_optimizer_continues_exactly():
    weights, gradients = weights_and_gradients(seed=1)

    def make():
        return BiasCorrectedAdamW(learning_rate=LEARNING_RATE, weight_decay=0.1)

    uninterrupted = keras_steps(make(), weights, gradients)
    first = make()
    halfway = keras_steps(first, weights, gradients[:3])
    second = make()
    variables = [keras.Variable(w) for w in halfway]
    second.build(variables)
    # The step count (iterations) drives the bias correction: it travels
    # with the optimizer's variables, as in a checkpoint.
    for target, source in zip(second.variables, first.variables):
        target.assign(source)
    for step_gradients in gradients[3:]:
        second.apply(
            [keras.ops.convert_to_tensor(g) for g in step_gradients], variables
        )
    for a, b in zip(uninterrupted, variables):
        np.testing.assert_array_equal(a, keras.ops.convert_to_numpy(b))


def test_serializes_by_name():
    optimizer = BiasCorrectedAdamW(learning_rate=3e-4, weight_decay=0.05)
    config = keras.optimizers.serialize(optimizer)
    assert config["registered_name"] == "keras_mhf>BiasCorrectedAdamW"
    again = keras.optimizers.deserialize(config)
    assert type(again) is BiasCorrectedAdamW
    assert again.get_config() == optimizer.get_config()


@pytest.mark.parametrize("name", ["adamw", "keras_adamw"])
def test_the_recipes_optimizer_by_name(name):
    from keras_mhf.pretraining import make_optimizer

    optimizer = make_optimizer(1e-3, total_steps=10, warmup_steps=2, name=name)
    expected = BiasCorrectedAdamW if name == "adamw" else keras.optimizers.AdamW
    assert type(optimizer).__mro__[0].__name__ == expected.__name__
    assert isinstance(optimizer, keras.optimizers.AdamW)
    assert (type(optimizer) is BiasCorrectedAdamW) == (name == "adamw")
    with pytest.raises(ValueError, match="Unknown optimizer 'sgd'"):
        make_optimizer(1e-3, 10, 2, name="sgd")


def test_bfloat16_weights_train_like_float32():
    """bf16 weights and moments (`--precision bfloat16`): the step is
    computed in float32 and stored in bf16, so it follows the float32
    optimizer to bf16 round-off. Keras' own AdamW computes `1 - beta_2**t`
    in bf16, where 0.999 is 1.0: it leaves the weights unchanged."""
    rng = np.random.default_rng(0)
    start = rng.normal(size=(8, 4)).astype("float32")
    grads = [rng.normal(size=(8, 4)).astype("float32") for _ in range(5)]

    def train(optimizer, dtype):
        w = keras.Variable(start, dtype=dtype)
        optimizer.build([w])
        for g in grads:
            optimizer.apply_gradients([(keras.ops.cast(g, dtype), w)])
        return keras.ops.convert_to_numpy(keras.ops.cast(w, "float32"))

    settings = dict(learning_rate=1e-2, weight_decay=0.0)
    full = train(BiasCorrectedAdamW(**settings), "float32")
    half = train(BiasCorrectedAdamW(**settings), "bfloat16")
    assert np.abs(full - start).min() > 1e-3  # every weight moved
    np.testing.assert_allclose(half, full, atol=0.02, rtol=0.01)
    frozen = train(keras.optimizers.AdamW(**settings), "bfloat16")
    np.testing.assert_allclose(
        frozen,
        keras.ops.convert_to_numpy(
            keras.ops.cast(keras.ops.cast(start, "bfloat16"), "float32")
        ),
    )
