"""A smoke run of `benchmarks.accumulation_memory` (gradient accumulation's
peak memory against the micro-batch's), so it cannot rot; its real runs are
in docs/performance.md. In this process, at a tiny size; once per suite
(`tests/conftest.py`)."""

import json

import pytest

from benchmarks import accumulation_memory


def test_accumulation_memory_smoke(tmp_path):
    out = tmp_path / "accumulation.json"
    accumulation_memory.main(["--smoke", "--output", str(out)])
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["batch"], r["micro_batches"]) for r in rows] == [(4, 1), (8, 2)]
    plain, accumulated = rows
    assert plain["ratio"] == 1.0 and accumulated["ratio"] > 0
    assert accumulated["micro_batch"] == plain["micro_batch"] == 4
    for r in rows:
        assert r["step_peak_mb"] >= 0 and r["total_peak_mb"] > 0
        # AdamW's moments (and its step counter).
        assert r["optimizer_state_mb"] == pytest.approx(
            2 * r["weights_mb"], 0.01
        )
    # The accumulators are one copy of the trainable weights.
    assert plain["accumulators_mb"] == 0
    assert accumulated["accumulators_mb"] == accumulated["weights_mb"]
    markdown = (tmp_path / "accumulation.md").read_text()
    assert "| batch | N | micro-batch | step peak MB |" in markdown
