"""Smoke runs of the benchmark, the profiler, the replication recipe, the
calibration experiment and the quantization quality tool, so none of them can
rot (their real runs are documented in the README). Each takes one to a few
minutes, so they are `large`: `tools/test.sh` runs them once, under JAX, after
the per-backend suites (`pytest --run_large -m large`). The measurement
scripts run as modules of the `benchmarks` package (`run_module`)."""

import json

import keras
import numpy as np
import pytest

from tests.conftest import MISTRAL_MODEL
from tests.conftest import run_module
from tests.conftest import run_script


@pytest.mark.large
def test_benchmark_smoke(tmp_path):
    backend = keras.config.backend()
    out = tmp_path / "bench.json"
    done = run_module(
        "benchmarks.benchmark",
        "--smoke",
        "--backends",
        backend,
        "--output",
        str(out),
    )
    report = json.loads(out.read_text())
    configs = {r["config"] for r in report["results"]}
    assert configs == {"standard", "h3b64"}
    for r in report["results"]:
        assert r["train_tokens_per_s"] > 0 and 0 < r["mfu"] < 1.5
        assert r["generate_ms_per_token_b1"] > 0 and r["score_tokens_per_s"] > 0
    assert "MHF/Std tok/s" in done.stdout


@pytest.mark.large
def test_paper_shape_benchmark_smoke(tmp_path):
    """`--paper-shape` (tiny trunk under `--smoke`): a fresh process per
    model, the rematerialised trunk, a ratio against Standard."""
    backend = keras.config.backend()
    run_module(
        "benchmarks.benchmark",
        "--paper-shape",
        "--smoke",
        "--backends",
        backend,
        "--vocab",
        "512",
        "--output",
        str(tmp_path / "paper.json"),
    )
    report = (tmp_path / f"paper_{backend}_v512.md").read_text()
    assert "(blocks rematerialised)" in report
    rows = [line for line in report.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| fused",
        "| standard",
    ]
    assert all(row.split(" | ")[2].isdigit() for row in rows[1:])


@pytest.mark.large
@pytest.mark.parametrize("inference", ["vocabulary", "quantization", "scoring"])
def test_inference_benchmark_smoke(tmp_path, inference):
    out = tmp_path / f"{inference}.json"
    run_module(
        "benchmarks.benchmark",
        "--inference",
        inference,
        "--smoke",
        "--output",
        str(out),
        timeout=900,
    )
    results = json.loads(out.read_text())["results"]
    report = (tmp_path / f"{inference}.md").read_text()
    if inference == "vocabulary":
        kinds = {(r["kind"], r["vocabulary_size"]) for r in results}
        assert kinds == {
            ("mhf", 512),
            ("standard", 512),
            ("mhf_random", 512),
            ("mhf_disagree", 512),
        }
        mhf = [r for r in results if r["kind"] == "mhf"]
        for r in mhf:
            assert r["mhf_candidates_ms_per_token_b1"] > 0
            assert 0.0 <= r["mhf_candidates_fallback_rate_b8"] <= 1.0
            assert r["mhf_score_tokens_per_s"] > 0
        assert "fallback" in report and (tmp_path / "vocabulary.png").exists()
        # The all-fallback table: candidates against the full scan.
        disagree = [r for r in results if r["kind"] == "mhf_disagree"]
        for r in disagree:
            assert r["disagree_full_ms_per_token_b8"] > 0
            assert 0.0 <= r["disagree_candidates_fallback_rate_b1"] <= 1.0
        assert "Every certificate fails" in report
    elif inference == "scoring":
        kinds = {(r["kind"], r["vocabulary_size"]) for r in results}
        assert kinds == {("mhf_score", 512), ("standard_score", 512)}
        for r in results:  # timed in turns in one process, 2 rounds
            assert r["score_tokens_per_s"] > 0 and r["rounds"] == 2
            assert r["forward_flops_per_token"] > 0
        assert "analytic FLOP ratio" in report
    else:
        by = {r["kind"]: r for r in results}
        assert set(by) == {
            "h3b64:float32",
            "h3b64:int8",
            "standard:float32",
            "standard:int8",
        }
        # int8 tables with per-row float scales: smaller than float32.
        assert (
            by["h3b64:int8"]["table_bytes"] < by["h3b64:float32"]["table_bytes"]
        )
        assert "| h3b64 | int8 |" in report


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


def test_profile_smoke():
    if keras.config.backend() != "jax":
        pytest.skip("benchmarks.profile_step uses the JAX profiler")
    done = run_module("benchmarks.profile_step", "--smoke")
    assert "## training step" in done.stdout and "## generation" in done.stdout
    # Ops are attributed to categories, and the matmuls are found.
    assert "matmul" in done.stdout and "top ops:" in done.stdout


@pytest.mark.large
def test_replicate_smoke(tmp_path, openstax_dir):
    done = run_script(
        "recipes/replicate.py",
        "--smoke",
        "--data",
        str(openstax_dir),
        "--tokenizer",
        str(MISTRAL_MODEL),
        "--output",
        str(tmp_path / "rep"),
        "--models",
        "standard",
        "mhf_h4",
        "single_id",
        timeout=900,
    )
    table = (tmp_path / "rep" / "results.md").read_text()
    for name in ("standard", "mhf_h4b256", "single_id_h1x4b256"):
        assert f"| {name} |" in table
    for column in (
        "val perplexity (paper rule)",
        "val perplexity (calibrated)",
        "temperature",
        "ECE (paper rule / calibrated)",
        "last-word acc",
    ):
        assert column in table
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:]]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| model")
    }
    # Standard: one rule, no calibrated numbers; MHF: both, and a temperature.
    assert rows["standard"][4] == "—" and rows["standard"][5] == "—"
    assert rows["standard"][6].endswith("/ —")
    assert float(rows["mhf_h4b256"][5]) > 0
    assert "—" not in rows["mhf_h4b256"][6]
    assert (tmp_path / "rep" / "val_loss.png").exists()
    runs = json.loads((tmp_path / "rep" / "results.json").read_text())["runs"]
    single = next(r for r in runs if r["model"].startswith("single_id"))
    assert single["signature_rule"] == "repeated"
    for run in runs:
        assert run["validation_windows"]["reported"] == [2, 4]
        if run["model"] == "standard":
            assert not run["calibrated"] and run["scoring_temperature"] is None
            assert run["validation_paper_rule"] == run["validation"]
        else:
            assert run["calibrated"]
            assert (
                run["scoring_temperature"]
                == (run["validation"]["scoring_temperature"])
            )
            paper = run["validation_paper_rule"]
            assert paper == run["validation"]["paper_rule"]

    # The calibration experiment runs on the trained presets of this run.
    done = run_script(
        "recipes/calibration_experiment.py",
        "--work-dir",
        str(tmp_path / "rep" / "runs"),
        "--output",
        str(tmp_path / "cal"),
        "--validation-blocks",
        "8",
        "--train-windows",
        "16",
        "--finetune-epochs",
        "1",
        "--models",
        "mhf_h4b256",
        timeout=900,
    )
    results = json.loads((tmp_path / "cal" / "results.json").read_text())
    (result,) = results.values()
    paper = result["paper_rule"]
    for method in ("scalar", "context", "context+scores", "finetune"):
        assert result[method]["loss"] > 0
    # A positive scale per position never changes the argmax.
    for method in ("scalar", "context", "context+scores"):
        assert result[method]["accuracy"] == paper["accuracy"]
    assert result["finetune"]["steps"] == 8
    assert "| seed0/mhf_h4b256 | context |" in (
        (tmp_path / "cal" / "results.md").read_text()
    )

    # ... and the quantization quality tool on the same preset.
    done = run_module(
        "benchmarks.quantization_quality",
        "--preset",
        str(tmp_path / "rep" / "runs" / "seed0" / "mhf_h4b256" / "preset"),
        "--data",
        str(tmp_path / "rep" / "runs" / "data"),
        "--prompts",
        "4",
        "--validation-blocks",
        "8",
        "--output",
        str(tmp_path / "quality.json"),
        timeout=900,
    )
    quality = json.loads((tmp_path / "quality.json").read_text())
    assert 0.0 <= quality["int8"]["greedy_identical"] <= 1.0
    assert abs(quality["int8"]["perplexity_change"]) < 0.1
    assert "| int8 |" in done.stdout
