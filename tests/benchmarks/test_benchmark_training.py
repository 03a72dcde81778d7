"""Smoke runs of `benchmarks.benchmark`'s training measurements (MHF
against Standard, and the paper-shape memory table), so they cannot rot;
their real runs are documented in docs/performance.md. Large: the large
step of tools/test.sh runs them once, under JAX."""

import json

import keras
import pytest

from tests.conftest import run_module


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
