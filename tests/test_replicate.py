"""Smoke run of the replication recipe (three models on the test slice of
OpenStax), then of the calibration experiment and the quantization quality
tool on the presets it trained, so none of them can rot (their real runs
are documented in docs/replication.md). Large: once, under JAX."""

import json

import pytest

from tests.conftest import MISTRAL_MODEL
from tests.conftest import run_module
from tests.conftest import run_script


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
