"""A smoke run of `benchmarks.serving` (`keras-mhf serve` with one client
and 8 at once), so it cannot rot; its real runs are in docs/performance.md.
`--quick`: a tiny MHF preset, one server subprocess, 8 new tokens."""

import json

import pytest

from tests.conftest import run_module


@pytest.mark.large
def test_serving_benchmark_quick(tmp_path):
    out = tmp_path / "serving.json"
    run_module("benchmarks.serving", "--quick", "--output", out, timeout=300)
    report = json.loads(out.read_text())
    assert report["target"] == 3.0
    settings = report["settings"]
    assert settings["clients"] == 8 and settings["max_tokens"] == 8
    (row,) = report["results"]
    assert row["model"] == row["served_name"] == "mhf"
    assert row["exit_status"] == 0  # stopped by SIGTERM, gracefully
    assert row["parameters"] > 0
    n = settings["max_tokens"]
    # The API cannot forbid `</s>`: an untrained model may stop early.
    assert 0 < row["single_tokens"] <= n
    assert 0 < row["concurrent_tokens"] <= 8 * n
    for key in (
        "single_tokens_per_s",
        "single_first_chunk_s",
        "concurrent_tokens_per_s",
        "concurrent_first_chunk_s",
        "batching_ratio",
    ):
        assert row[key] > 0, key
    assert row["batching_ratio"] == pytest.approx(
        row["concurrent_tokens_per_s"] / row["single_tokens_per_s"]
    )
    # The 8 requests ran in at most 8 batches, of 8 rows in all.
    assert row["batched_rows"] == 8 and 1 <= row["batches"] <= 8
    assert report["mhf_over_standard"] == {}
    markdown = (tmp_path / "serving.md").read_text()
    assert "| model | 1 client tok/s |" in markdown
