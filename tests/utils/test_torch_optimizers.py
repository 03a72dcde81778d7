"""`update_in_groups` (PyTorch's optimizer update with small temporaries,
#23): bit-identical weights to Keras' update, groups bounded in bytes, and
the tasks' `compile` using it."""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.config.backend() != "torch", reason="a PyTorch-only module"
)


def trained_weights(lean, group_bytes):
    from keras_mhf.utils.torch_optimizers import update_in_groups

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16), keras.layers.Dense(3)]
    )
    optimizer = keras.optimizers.AdamW(1e-2, weight_decay=0.1)
    if lean:
        update_in_groups(optimizer, group_bytes)
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 6)), rng.normal(size=(8, 3))
    for _ in range(3):
        model.train_on_batch(x, y)
    return [keras.ops.convert_to_numpy(w) for w in model.weights]


def test_grouped_updates_give_identical_weights():
    plain = trained_weights(False, None)
    for group_bytes in (1, 100, 1 << 20):  # one variable, some, all
        for a, b in zip(plain, trained_weights(True, group_bytes)):
            np.testing.assert_array_equal(a, b)


def test_groups_hold_at_most_group_bytes_or_one_variable():
    from keras_mhf.utils.torch_optimizers import variable_groups

    sizes = [10, 30, 50, 200, 5, 5, 60]  # float32 elements
    variables = [keras.Variable(np.zeros(n, "float32")) for n in sizes]
    groups = variable_groups(variables, group_bytes=160)
    assert groups == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]


def test_tasks_compile_with_grouped_updates():
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.utils.keras_utils import memory_lean

    lm = MultiHashFormerCausalLM.from_tokens(
        [f"t{i}" for i in range(40)], "tiny_h3b64", pad_token_id=0
    )
    lm.compile(optimizer=keras.optimizers.AdamW(1e-3))
    assert lm.optimizer._parallel_update_step.in_groups
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    assert memory_lean(scaled) is scaled
    assert scaled.inner_optimizer._parallel_update_step.in_groups
