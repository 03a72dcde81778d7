import os
import subprocess
import sys

import keras
import pytest

from tests.conftest import run_module

JAX_ONLY = pytest.mark.skipif(
    keras.config.backend() != "jax",
    reason="keras.distribution works on JAX only",
)

MULTI_DEVICE = r"""
import os, sys
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
import numpy as np, keras, jax
from keras_mhf.pretraining.distribution import make_distribution, check_batch_size
from keras_mhf.models import MultiHashFormerCausalLM


def build(head_block_size=5):
    # Block size 5 does not divide the 64 positions of a batch (fused head).
    keras.utils.set_random_seed(0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(61)]
    model = MultiHashFormerCausalLM.from_tokens(
        tokens, "tiny_h3b64", pad_token_id=2, gate_dim=8, mixer_dim=8,
        head_block_size=head_block_size)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


assert len(jax.devices()) == 8
rng = np.random.default_rng(0)
ids = rng.integers(3, 64, size=(16, 9)).astype("int32")
x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((16, 8), "int32")}
y = ids[:, 1:]
single = build().fit(
    x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]

unchunked = build(0).fit(
    x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]
np.testing.assert_allclose(single, unchunked, rtol=1e-5)

keras.distribution.set_distribution(make_distribution("data"))
data_parallel = build().fit(
    x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]
np.testing.assert_allclose(data_parallel, single, atol=1e-5)

# Gradient accumulation under FSDP (accumulators sharded as their weights):
# 2 micro-batches of 8 per step train as the batch of 16 on one device.
from keras_mhf.pretraining.training import make_optimizer


def build_adamw(parts):
    model = build()
    model.compile(optimizer=make_optimizer(
        1e-2, 2, 1, gradient_accumulation_steps=parts))
    return model


keras.distribution.set_distribution(None)
whole = build_adamw(1)
whole.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
keras.distribution.set_distribution(make_distribution("fsdp"))
accumulated = build_adamw(2)
accumulated.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
assert int(accumulated.optimizer.iterations) == 2
for a, b in zip(whole.weights, accumulated.weights):
    # Adam's m / sqrt(v) magnifies the rounding of sharded sums where a
    # gradient is ~0: within 1% of a step (lr 1e-2) everywhere, and 1e-6 on
    # average; the gate's bias has a gradient of exactly 0.
    if a.path != "hash_encoder/score_dense/bias":
        ours, theirs = np.asarray(b.value), np.asarray(a.value)
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4,
                                   err_msg=a.path)
        assert np.abs(ours - theirs).mean() < 1e-6, a.path

dist = make_distribution("model", "2x4")
keras.distribution.set_distribution(dist)
model = build()
model_parallel = model.fit(
    x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]
assert model_parallel[1] < model_parallel[0], model_parallel
np.testing.assert_allclose(model_parallel, single, rtol=1e-3)
specs = {v.path: tuple(v.value.sharding.spec) for v in model.weights}
assert specs["hash_encoder/embeddings_0"] == ("model", "batch"), (
    specs["hash_encoder/embeddings_0"])
assert specs["signature_lookup/signatures"] in ((), (None, None))
assert specs["transformer_layer_0/self_attention/query/kernel"] == (
    "model", "batch", None)
assert specs["hash_decoder/mixer_0_down_dense/kernel"] == ("batch", "model")
assert len(
    model.backbone.hash_encoder.embeddings[-1].value.sharding.device_set) == 8
model.compile(sampler="greedy")
prompt = {"token_ids": x["token_ids"][:8],
          "padding_mask": np.zeros((8, 8), bool)}
prompt["padding_mask"][:, :3] = True
out = model.generate(prompt, stop_token_ids=None)
assert np.asarray(out["token_ids"]).shape == (8, 8)
assert np.asarray(model.score(x["token_ids"][:8])).shape == (8, 8, 64)
try:
    check_batch_size(3, dist)
    raise SystemExit("batch 3 on a 2-way batch axis was accepted")
except ValueError as error:
    assert "does not divide" in str(error)
print("OK")
"""


@JAX_ONLY
def test_data_and_model_parallel_on_8_cpu_devices():
    env = dict(os.environ, KERAS_BACKEND="jax")
    done = subprocess.run(
        [sys.executable, "-c", MULTI_DEVICE],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-4000:]


@JAX_ONLY
def test_pretrain_recipe_with_model_parallelism(tmp_path):
    from tests.pretraining_helpers import write_documents

    data = write_documents(tmp_path / "corpus.jsonl")
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
        + " --xla_force_host_platform_device_count=8",
    )
    done = run_module(
        "keras_mhf.cli.main",
        "pretrain",
        "--data",
        data,
        "--output",
        str(tmp_path / "run"),
        "--validation-fraction",
        "0.2",
        "--validation-blocks",
        "4",
        "--architecture",
        "tiny_h3b64",
        "--vocabulary-size",
        "400",
        "--sequence-length",
        "16",
        "--batch-size",
        "4",
        "--steps",
        "2",
        "--checkpoint-every",
        "2",
        "--distribution",
        "model",
        "--mesh",
        "2x4",
        env=env,
    )
    assert '"finished": true' in done.stdout
    # A 1x8 mesh splits the model axis 8 ways, which 4 query heads do not
    # divide: the recipe fits the layout to the model (those dimensions are
    # replicated) instead of failing inside JAX when the weights are made.
    command = list(done.args[2:])  # after `python -m`
    command[command.index("--output") + 1] = str(tmp_path / "run_1x8")
    command[command.index("--mesh") + 1] = "1x8"
    done = run_module(*command, env=env)
    assert '"finished": true' in done.stdout


@JAX_ONLY
@pytest.mark.large
def test_two_processes_end_with_the_single_process_weights():
    """Fully sharded over 2 processes x 4 devices: each process holds half
    of the weights, the job ends within 1e-5 of one process, a job whose
    process 1 is SIGKILLed mid-checkpoint resumes to the bit, and its
    checkpoint resumes on one device (`benchmarks.multiprocess_check`)."""
    env = dict(os.environ, KERAS_BACKEND="jax")
    done = run_module("benchmarks.multiprocess_check", timeout=900, env=env)
    assert "OK" in done.stdout


@pytest.mark.skipif(
    keras.config.backend() == "jax",
    reason="tests the refusal on other backends",
)
def test_other_backends_refuse_instead_of_training_on_one_device(
    tmp_path, corpus
):
    from keras_mhf.pretraining import pretrain
    from keras_mhf.pretraining.distribution import make_distribution

    with pytest.raises(ValueError, match="KERAS_BACKEND=jax"):
        make_distribution("data")
    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join(corpus))
    with pytest.raises(ValueError, match="needs the JAX backend"):
        pretrain(
            str(data),
            str(tmp_path / "run"),
            distribution="data",
            steps=2,
            verbose=0,
        )
    assert not (tmp_path / "run").exists()


def test_a_model_axis_across_processes_is_refused_naming_fsdp():
    """Processes stream disjoint rows, so a model axis may not span two of
    them; one that stays inside each process is fine."""
    import types

    from keras_mhf.pretraining.distribution import check_model_axis
    from keras_mhf.pretraining.distribution import fsdp_axes

    def layout(batch, model):
        mesh = types.SimpleNamespace(
            axis_names=["batch", "model"], shape=[batch, model]
        )
        return types.SimpleNamespace(device_mesh=mesh)

    check_model_axis(layout(2, 4), local_devices=4)  # one row per process
    with pytest.raises(ValueError, match="--distribution fsdp"):
        check_model_axis(layout(1, 8), local_devices=4)
    # FSDP splits the largest dimension the devices divide.
    assert fsdp_axes((96, 1024), 8) == [None, "batch"]
    assert fsdp_axes((7, 3), 8) == [None, None]
