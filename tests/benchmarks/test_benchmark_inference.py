"""Smoke runs of `benchmarks.benchmark --inference` (generation against the
vocabulary, quantized decoding, scoring), so they cannot rot; their real
runs are documented in docs/performance.md. Large: the large step of
tools/test.sh runs them once, under JAX."""

import json

import pytest

from tests.conftest import run_module


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
