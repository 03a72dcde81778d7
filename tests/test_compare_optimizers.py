"""The replication recipes' bookkeeping: `recipes/compare_optimizers.py`
pools results folders as its docstring says (each (seed, model) once, the
first folder's; `FOLDER:MODEL,...` takes only those models), and
`recipes/replicate.py` keeps finished runs. Backend-independent: JSON."""

import json
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))

import compare_optimizers  # noqa: E402


def run(seed, model, perplexity):
    return {
        "seed": seed,
        "model": model,
        "validation": {"perplexity": perplexity, "accuracy": 0.1},
        "validation_paper_rule": {"perplexity": perplexity},
        "calibrated": False,
        "scoring_temperature": None,
        "update_sizes": {"gate scorer": {"2": 0.5}},
    }


def folder(tmp_path, name, runs):
    path = tmp_path / name
    path.mkdir()
    (path / "results.json").write_text(json.dumps({"runs": runs}))
    return str(path)


def test_arms_pool_each_seed_and_model_once(tmp_path):
    rerun = folder(
        tmp_path, "rerun", [run(0, "standard", 10.0), run(0, "mhf", 20.0)]
    )
    mhf = folder(tmp_path, "mhf", [run(0, "mhf", 99.0), run(1, "mhf", 30.0)])
    old = folder(
        tmp_path, "old", [run(1, "standard", 12.0), run(1, "mhf", 77.0)]
    )
    pooled = compare_optimizers.pooled([rerun, mhf, f"{old}:standard"])
    assert [
        (r["seed"], r["model"], r["validation"]["perplexity"]) for r in pooled
    ] == [
        (0, "standard", 10.0),
        (0, "mhf", 20.0),
        (1, "mhf", 30.0),
        (1, "standard", 12.0),
    ]
    table = compare_optimizers.metrics_table(
        [("before", pooled), ("after", pooled)]
    )
    assert "| mhf | before (seeds 0, 1) | 25.0 ± 7.1 |" in table


def test_replicate_keeps_the_runs_of_the_same_settings(tmp_path):
    """`recipes/replicate.py` rerun with more seeds trains only the missing
    runs: those of a results.json with the same settings (seeds aside) are
    kept; other settings keep nothing."""
    import replicate

    config = {"trunk": "mini", "steps": 300, "seeds": 1, "optimizer": "adamw"}
    path = tmp_path / "results.json"
    path.write_text(
        json.dumps({"config": config, "runs": [run(0, "mhf", 20.0)]})
    )
    kept = replicate._finished_runs(str(path), dict(config, seeds=3))
    assert list(kept) == [(0, "mhf")]
    assert replicate._finished_runs(str(path), dict(config, steps=10)) == {}
    assert replicate._finished_runs(str(tmp_path / "none.json"), config) == {}
