"""The accelerator run-book (`benchmarks/accelerator_check.sh`) at tiny
shapes on CPU (large: once, under JAX), and `benchmarks.head_blocking`,
which reads the fused head's blocking from XLA's compiled program at a
device's shape (JAX pass)."""

import json

import keras
import numpy as np
import pytest

from tests.conftest import run_module
from tests.conftest import run_script


@pytest.mark.large
def test_accelerator_check_smoke(tmp_path):
    """The accelerator run-book's command at tiny shapes on CPU: MHF and
    Standard trained and decoded, with MFU, memory and ratios written."""
    run_script(
        "benchmarks/accelerator_check.sh", "--smoke", "--output", str(tmp_path)
    )
    report = json.loads((tmp_path / "accelerator_check.json").read_text())
    assert [r["model"] for r in report["train"]] == ["standard", "h4b64"]
    for row in report["train"]:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu_measured_peak"]
        assert row["peak_memory_bytes"] > 0 and np.isfinite(row["loss"])
    assert all(r["decode_ms_per_token_b1"] > 0 for r in report["decode"])
    # Two probes give the memory per sequence; the fused head's blocking on
    # this device (a CPU: 2^24 logits per block) is reported.
    assert [len(r["probes"]) for r in report["train"]] == [2, 2]
    assert report["train"][1]["head_block_size"] == 2**24 // (4 * 64)
    table = (tmp_path / "accelerator_check.md").read_text()
    assert "MHF/Std tokens/s" in table and "x |" in table


def test_head_blocking_reads_the_compiled_program(tmp_path):
    """`benchmarks.head_blocking` at a small width: the block loop's trips
    and the head's largest matmul are read from XLA's program."""
    if keras.config.backend() != "jax":
        pytest.skip("benchmarks.head_blocking compiles with JAX")
    out = tmp_path / "head_blocking.md"
    run_module(
        "benchmarks.head_blocking",
        "--batch",
        "1",
        "--sequence-length",
        "1024",
        "--hidden-dim",
        "64",
        "--out",
        str(out),
    )
    rows = out.read_text().splitlines()
    # 1,024 positions: 4 blocks of 256 (CPU), one block on the devices.
    assert "| CPU | 256 | 4 | 0.3 G: [256, 64] -> [64, 16384] |" in rows[-4]
    assert "| H100, JAX (60 GB) | 2048 | 1 | 1.1 G:" in rows[-3]
