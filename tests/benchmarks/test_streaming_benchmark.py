"""A smoke run of `benchmarks.streaming` (`generate_stream` against
`generate`, MHF and Standard), so it cannot rot; its real runs are in
docs/performance.md. `--quick` (a tiny model, 8 tokens) in a PyTorch
process, whose tiny models need no compiling (under JAX its compiles take
most of half a minute), started from the large step: what it checks is the
script, and `generate_stream` itself is tested on every backend."""

import json
import os

import pytest

from tests.conftest import run_module

MODEL_FIELDS = {
    "model",
    "parameters",
    "new_tokens",
    "chunk_size",
    "generate_s",
    "generate_tokens_per_s",
    "stream_s",
    "stream_tokens_per_s",
    "stream_ratio",
    "first_token_s",
    "first_piece_s",
    "id_generate_s",
    "id_generate_tokens_per_s",
    "id_stream_s",
    "id_stream_tokens_per_s",
    "id_stream_ratio",
    "same_text",
    "tokens",
}


@pytest.mark.large
def test_streaming_benchmark_quick(tmp_path):
    out = tmp_path / "streaming.json"
    env = dict(os.environ, KERAS_BACKEND="torch")
    run_module(
        "benchmarks.streaming",
        "--quick",
        "--output",
        out,
        timeout=120,
        env=env,
    )
    report = json.loads(out.read_text())
    assert report["backend"] == "torch" and report["target"] == 0.8
    settings = report["settings"]
    assert settings["quick"] and settings["batch_size"] == 1
    rows = report["results"]
    assert [r["model"] for r in rows] == ["mhf", "standard"]
    for r in rows:
        assert MODEL_FIELDS <= set(r)
        assert r["tokens"] == r["new_tokens"] == settings["new_tokens"]
        # The stream's text is generate's.
        assert r["same_text"] is True
        assert r["generate_tokens_per_s"] > 0 and r["stream_tokens_per_s"] > 0
        assert r["stream_ratio"] == pytest.approx(
            r["stream_tokens_per_s"] / r["generate_tokens_per_s"]
        )
        # The first token comes before the stream has ended.
        assert 0 < r["first_token_s"] < r["id_stream_s"]
    assert set(report["mhf_over_standard"]) >= {
        "generate_tokens_per_s",
        "stream_tokens_per_s",
        "first_token_s",
    }
    sizes = {(r["model"], r["chunk_size"]) for r in report["chunk_sizes"]}
    assert sizes == {
        (m, c) for m in ("mhf", "standard") for c in settings["chunk_sizes"]
    }
    for model in ("mhf", "standard"):
        profile = report["profile"][model]
        assert profile["detokenize_pushes"] >= 2
        assert profile["per_call_ms"] is not None
    markdown = (tmp_path / "streaming.md").read_text()
    assert "| model | `generate` tok/s | stream tok/s |" in markdown
