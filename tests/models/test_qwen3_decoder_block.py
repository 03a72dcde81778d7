import json
import os
import subprocess
import sys

import numpy as np
from keras import ops
from keras_hub.src.tests.test_case import TestCase

from keras_mhf.models import Qwen3DecoderBlock
from tests.conftest import REPO

STOCK_QWEN3 = r"""
import json, sys
import numpy as np, keras
from keras_hub.models import Qwen3Backbone


def stock():
    keras.utils.set_random_seed(0)
    backbone = Qwen3Backbone(vocabulary_size=50, num_layers=1,
                             num_query_heads=2, num_key_value_heads=1,
                             head_dim=8, hidden_dim=16, intermediate_dim=32,
                             layer_norm_epsilon=2e-6)
    attention = backbone.transformer_layers[0]._self_attention_layer
    ids = np.arange(12, dtype="int32").reshape(2, 6)
    out = backbone({"token_ids": ids, "padding_mask": np.ones_like(ids)})
    return {
        "q_epsilon": attention._query_dense_layer_norm.epsilon,
        "k_epsilon": attention._key_dense_layer_norm.epsilon,
        "config_keys": sorted(backbone.transformer_layers[0].get_config()),
        "output": np.asarray(keras.ops.convert_to_numpy(out)).tolist(),
    }


assert "keras_mhf" not in sys.modules
results = {"without": stock()}
import keras_mhf  # noqa: E402, F401
results["with"] = stock()
print(json.dumps(results))
"""


def test_importing_keras_mhf_leaves_stock_qwen3_unchanged():
    """No process-wide patch: KerasHub's own Qwen3Backbone behaves the same
    before and after `import keras_mhf` (its 0.32 q/k-norm epsilon bug
    included), in a fresh process that imports keras_mhf only between the
    two."""
    done = subprocess.run(
        [sys.executable, "-c", STOCK_QWEN3],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["with"] == results["without"]
    assert results["without"]["q_epsilon"] == 1e-5  # KerasHub's own behaviour


class Qwen3DecoderBlockTest(TestCase):
    def setUp(self):
        self.init_kwargs = dict(
            intermediate_dim=32,
            num_query_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            layer_norm_epsilon=2e-6,
        )

    def test_layer_behaviors(self):
        self.run_layer_test(
            Qwen3DecoderBlock,
            init_kwargs=self.init_kwargs,
            input_data=np.random.default_rng(0)
            .normal(size=(2, 5, 16))
            .astype("float32"),
            expected_output_shape=(2, 5, 16),
            # q, k, v, output kernels, q/k norms, two block norms, 3 MLP
            # kernels.
            expected_num_trainable_weights=11,
            # KerasHub's block cannot compute an output spec from numpy inputs
            # (its compute_output_shape returns the input), which the
            # precision check needs; mixed precision is tested on the models.
            run_precision_checks=False,
        )

    def test_every_norm_uses_the_block_epsilon(self):
        block = Qwen3DecoderBlock(**self.init_kwargs)
        block.build((None, None, 16))
        attention = block._self_attention_layer
        self.assertEqual(attention._query_dense_layer_norm.epsilon, 2e-6)
        self.assertEqual(attention._key_dense_layer_norm.epsilon, 2e-6)
        self.assertEqual(block._self_attention_layernorm.epsilon, 2e-6)

    def test_config_round_trip(self):
        block = Qwen3DecoderBlock(**self.init_kwargs, sliding_window_size=None)
        config = block.get_config()
        self.assertEqual(config["head_dim"], 8)
        self.assertIn("sliding_window_size", config)
        clone = Qwen3DecoderBlock.from_config(config)
        self.assertEqual(clone.get_config(), config)

    def test_same_numbers_as_the_stock_block_at_the_stock_epsilon(self):
        from keras_hub.src.models.qwen3.qwen3_decoder import (
            Qwen3TransformerDecoder,
        )

        x = np.random.default_rng(1).normal(size=(1, 4, 16)).astype("float32")
        kwargs = {
            **self.init_kwargs,
            "layer_norm_epsilon": 1e-5,
            "activation": "silu",
            "rope_max_wavelength": 10000,
            "kernel_initializer": "glorot_uniform",
        }
        ours = Qwen3DecoderBlock(**kwargs)
        stock = Qwen3TransformerDecoder(**kwargs)
        ours(x)
        stock(x)
        for a, b in zip(ours.weights, stock.weights):
            b.assign(a)
        self.assertAllClose(
            ops.convert_to_numpy(ours(x)),
            ops.convert_to_numpy(stock(x)),
            atol=0,
        )

    def test_rematerialize_is_in_the_config_and_refuses_dropout(self):
        block = Qwen3DecoderBlock(**self.init_kwargs, rematerialize=True)
        config = block.get_config()
        self.assertTrue(config["rematerialize"])
        self.assertTrue(Qwen3DecoderBlock.from_config(config).rematerialize)
        with self.assertRaisesRegex(ValueError, "needs dropout=0"):
            Qwen3DecoderBlock(
                **self.init_kwargs, rematerialize=True, dropout=0.1
            )


def _train(model, rematerialize):
    """Two compiled SGD steps; the losses and the final weights."""
    import keras

    rng = np.random.default_rng(0)
    ids = rng.integers(3, 64, (4, 9)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((4, 8), "int32")}
    x["padding_mask"][1, 6:] = 0
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    history = model.fit(x, ids[:, 1:], batch_size=4, epochs=2, verbose=0)
    assert all(
        block.rematerialize is rematerialize
        for block in model.backbone.transformer_layers
    )
    return history.history["loss"], [
        ops.convert_to_numpy(w) for w in model.weights
    ]


def test_rematerialized_trunks_train_the_same():
    """`rematerialize=True` (both backbones) recomputes the blocks in the
    backward pass of the compiled train step: the same losses and weights
    after two steps (MHF with its fused head, whose blocks are
    rematerialised too, and Standard)."""
    import keras

    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import StandardCausalLM
    from keras_mhf.models import standard_backbone

    tokens = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    builders = {
        "mhf": lambda remat: MultiHashFormerCausalLM.from_tokens(
            tokens, "tiny_h3b64", pad_token_id=0, rematerialize=remat
        ),
        "standard": lambda remat: StandardCausalLM(
            standard_backbone(64, "tiny", rematerialize=remat), None
        ),
    }
    for name, make in builders.items():
        results = []
        for remat in (False, True):
            keras.utils.set_random_seed(0)
            results.append(_train(make(remat), remat))
        (ref_losses, ref_weights), (losses, weights) = results
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=name)
        scale = max(np.abs(w).max() for w in ref_weights)
        for w, ref in zip(weights, ref_weights):
            np.testing.assert_allclose(w, ref, atol=1e-6 * scale, err_msg=name)
