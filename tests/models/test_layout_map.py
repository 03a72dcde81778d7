import os
import subprocess
import sys

import keras
import pytest

from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.models import architecture_config
from keras_mhf.models.multi_hash_former.multi_hash_former_layout import (
    weight_shapes,
)

FITTED = r"""
import os
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
import warnings
import numpy as np, keras
from keras_mhf.pretraining.distribution import make_distribution
from keras_mhf.models import MultiHashFormerBackbone, MultiHashFormerCausalLM
from keras_mhf.models import architecture_config
from keras_mhf.models.multi_hash_former.multi_hash_former_layout import check_layout_map

# tiny: 2 KV heads, which a 4-way "batch" axis cannot split.
config = architecture_config("tiny_h3b64", gate_dim=8, mixer_dim=8)
mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"))
# The KerasHub way: no config. Before a model is built the map holds the
# plain rules, which check_layout_map refuses, naming weight, dim and axis.
layout_map = MultiHashFormerBackbone.get_layout_map(mesh)
try:
    check_layout_map(layout_map, config)
    raise SystemExit("an unfit layout was accepted")
except ValueError as error:
    message = str(error)
    assert "transformer_layer_0/self_attention/key/kernel" in message, message
    assert "dimension 1 (2)" in message and "'batch' of size 4" in message
# With config= the map is fitted at once (and the check passes).
check_layout_map(make_distribution("model", "4x2", config=config)
                 ._layout_map, config)

keras.distribution.set_distribution(
    keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
)
tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(61)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = MultiHashFormerCausalLM.from_tokens(
        tokens, "tiny_h3b64", pad_token_id=2, gate_dim=8, mixer_dim=8
    )
messages = [str(w.message) for w in caught if "layout" in str(w.message)]
assert len(messages) == 1, messages
assert (
    "transformer_layer_*/self_attention/key/kernel dimension 1 (2) over "
    "mesh axis 'batch' of size 4 (2 weights)" in messages[0]
), messages[0]
assert "value/kernel" in messages[0] and "query" not in messages[0]
# The fitted map passes the check that the plain rules failed.
check_layout_map(layout_map, config)
model.compile(optimizer=keras.optimizers.SGD(0.1))
ids = np.random.default_rng(0).integers(3, 64, size=(8, 9)).astype("int32")
x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((8, 8), "int32")}
history = model.fit(x, ids[:, 1:], batch_size=8, epochs=1, verbose=0)
assert np.isfinite(history.history["loss"][0])
specs = {v.path: tuple(v.value.sharding.spec) for v in model.weights}
# The KV-head axis is replicated; what divides stays sharded.
assert specs["transformer_layer_0/self_attention/key/kernel"][:2] == (
    "model", None), specs["transformer_layer_0/self_attention/key/kernel"]
assert specs["transformer_layer_0/self_attention/query/kernel"][:2] == (
    "model", "batch")
assert specs["hash_encoder/embeddings_0"] == ("model", "batch")
print("OK")
"""


def test_weight_shapes_match_a_built_model(small_tokenizer):
    """The analytic shapes that the layout is fitted to are the real ones."""
    lm = MultiHashFormerCausalLM.from_tokenizer(
        small_tokenizer, "tiny_h3b64", sequence_length=8
    )
    config = lm.backbone.get_config()
    built = {w.path: tuple(w.shape) for w in lm.weights}
    shapes = weight_shapes(config)
    assert shapes and all(
        built[path] == shape for path, shape in shapes.items()
    )
    assert weight_shapes(architecture_config("tiny_h3b64")) == shapes


@pytest.mark.skipif(
    keras.config.backend() != "jax", reason="keras.distribution is JAX-only"
)
def test_layout_fits_the_model_and_unfit_layouts_are_refused():
    env = dict(os.environ, KERAS_BACKEND="jax")
    done = subprocess.run(
        [sys.executable, "-c", FITTED],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
