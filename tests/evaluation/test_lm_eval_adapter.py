import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_mhf import evaluation
from tests.conftest import REPO

pytest.importorskip("lm_eval")

LAMBADA_TASK = """task: tiny_lambada
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' ' + text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def test_lm_eval_command_on_local_tasks(tiny_lm, small_tokenizer, tmp_path):
    preset = str(tmp_path / "preset")
    tiny_lm.save_to_preset(preset)
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text(
        "".join(
            json.dumps({"text": t}) + "\n"
            for t in [
                "The cell is the basic unit of life",
                "Water boils at one hundred degrees",
                "Light travels faster than sound",
            ]
        )
    )
    mc = tmp_path / "mc.jsonl"
    mc.write_text(
        "".join(
            json.dumps(d) + "\n"
            for d in [
                {
                    "query": "Water boils at",
                    "choices": ["one hundred degrees", "cells"],
                    "gold": 0,
                },
                {
                    "query": "The cell is",
                    "choices": ["light", "the basic unit of life"],
                    "gold": 1,
                },
                {
                    "query": "An atom has",
                    "choices": ["a nucleus", "demand"],
                    "gold": 0,
                },
            ]
        )
    )
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_lambada.yaml").write_text(LAMBADA_TASK.format(path=lambada))
    (tasks / "tiny_mc.yaml").write_text(MC_TASK.format(path=mc))
    out = tmp_path / "out"
    env = dict(
        os.environ,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(REPO),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_mhf.evaluation.lm_eval_adapter",
            "--model",
            "keras_mhf",
            "--model_args",
            f"preset={preset}",
            "--batch_size",
            "2",
            "--tasks",
            "tiny_lambada,tiny_mc",
            "--include_path",
            str(tasks),
            "--output_path",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results_file = next(
        os.path.join(root, f)
        for root, _, files in os.walk(out)
        for f in files
        if f.startswith("results") and f.endswith(".json")
    )
    results = json.load(open(results_file))["results"]
    ours_lambada, _ = evaluation.lambada(tiny_lm, small_tokenizer, str(lambada))
    ours_mc, _ = evaluation.multiple_choice(tiny_lm, small_tokenizer, str(mc))
    np.testing.assert_allclose(
        results["tiny_lambada"]["perplexity,none"],
        ours_lambada["perplexity"],
        rtol=1e-4,
    )
    assert results["tiny_lambada"]["acc,none"] == ours_lambada["acc"]
    assert results["tiny_mc"]["acc,none"] == ours_mc["acc"]
    assert results["tiny_mc"]["acc_norm,none"] == ours_mc["acc_norm"]
