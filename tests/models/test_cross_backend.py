"""A model saved under the current backend loads under all three with the
same outputs. The suite runs once per backend, so the three runs cover the
3 x 3 matrix."""

import os
import subprocess
import sys
from unittest import mock

import keras
import numpy as np
from keras import ops

from tests.conftest import REPO

LOADER = """
import json, sys, numpy as np, keras
import keras_mhf
from keras import ops
model = keras.saving.load_model(sys.argv[1])
batch = dict(np.load(sys.argv[2]))
out = ops.convert_to_numpy(model(
    {"token_ids": batch["token_ids"], "padding_mask": batch["padding_mask"]}))
lp = ops.convert_to_numpy(
    model.score(batch["token_ids"], batch["padding_mask"]))
model.compile(sampler="greedy")
model.preprocessor = None
gen = ops.convert_to_numpy(model.generate(
    {"token_ids": batch["token_ids"], "padding_mask": batch["prompt_mask"]},
    stop_token_ids=None)["token_ids"])
np.savez(sys.argv[3], out=out, lp=lp, gen=gen)
"""


def test_saved_model_loads_on_every_backend(tiny_lm, corpus, tmp_path):
    x, _, _ = tiny_lm.preprocessor(corpus[:2])
    token_ids = np.asarray(ops.convert_to_numpy(x["token_ids"]))
    padding_mask = np.asarray(ops.convert_to_numpy(x["padding_mask"])).astype(
        "int32"
    )
    prompt_mask = np.zeros_like(padding_mask)
    prompt_mask[:, :4] = 1
    batch_path = str(tmp_path / "batch.npz")
    np.savez(
        batch_path,
        token_ids=token_ids,
        padding_mask=padding_mask,
        prompt_mask=prompt_mask,
    )
    path = str(tmp_path / "lm.keras")
    tiny_lm.save(path)
    script = str(tmp_path / "load.py")
    open(script, "w").write(LOADER)
    results = {}
    here = keras.config.backend()
    # This backend loads in this process (the same script, without the
    # start-up of a new interpreter); the other two in their own processes.
    out_path = str(tmp_path / f"{here}.npz")
    with mock.patch.object(
        sys, "argv", ["load.py", path, batch_path, out_path]
    ):
        exec(compile(LOADER, script, "exec"), {})
    results[here] = dict(np.load(out_path))
    for backend in sorted({"jax", "tensorflow", "torch"} - {here}):
        out_path = str(tmp_path / f"{backend}.npz")
        env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(REPO))
        done = subprocess.run(
            [sys.executable, script, path, batch_path, out_path],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"{backend}: {done.stderr[-3000:]}"
        results[backend] = dict(np.load(out_path))
    for backend, result in results.items():
        np.testing.assert_allclose(
            result["out"], results[here]["out"], atol=1e-4, err_msg=backend
        )
        np.testing.assert_allclose(
            result["lp"], results[here]["lp"], atol=1e-4, err_msg=backend
        )
        np.testing.assert_array_equal(
            result["gen"], results[here]["gen"], err_msg=backend
        )
    np.testing.assert_allclose(
        results[here]["out"],
        np.asarray(ops.convert_to_numpy(tiny_lm(x))),
        atol=1e-5,
    )
