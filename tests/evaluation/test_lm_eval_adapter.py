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
    ours_lambada, lambada_examples = evaluation.lambada(
        tiny_lm, small_tokenizer, str(lambada)
    )
    ours_mc, mc_examples = evaluation.multiple_choice(
        tiny_lm, small_tokenizer, str(mc)
    )
    expected = {
        "tiny_lambada": [[e["loglikelihood"]] for e in lambada_examples],
        "tiny_mc": [e["loglikelihoods"] for e in mc_examples],
    }
    # Our adapter on the preset, and lm-eval's own `hf` model on the
    # Hugging Face export (its modeling code, trust_remote_code; `<s>`
    # first, as keras_mhf scores every context). logits_cache=False: with
    # it, lm-eval's `hf` model reuses one request's logits for another
    # whose tokens but the last are the same, and slices them with the
    # first one's continuation length, so a LAMBADA passage and a question
    # of the same text split elsewhere ("The cell is the basic unit of" +
    # " life", "The cell is" + " the basic unit of life") got -18.91
    # instead of -19.55 (lm-eval 0.4.13; the case of lm-eval issue #2984).
    hf = str(tmp_path / "hf")
    tiny_lm.export_to_transformers(hf)
    for model, model_args in (
        ("keras_mhf", f"preset={preset}"),
        (
            "hf",
            f"pretrained={hf},trust_remote_code=True,add_bos_token=True,"
            "logits_cache=False",
        ),
    ):
        results, samples = run_lm_eval(
            model, model_args, tasks, tmp_path / f"out_{model}", tmp_path
        )
        for task, per_example in expected.items():
            np.testing.assert_allclose(
                samples[task], per_example, atol=1e-4, rtol=0, err_msg=model
            )
        np.testing.assert_allclose(
            results["tiny_lambada"]["perplexity,none"],
            ours_lambada["perplexity"],
            rtol=1e-4,
        )
        assert results["tiny_lambada"]["acc,none"] == ours_lambada["acc"]
        assert results["tiny_mc"]["acc,none"] == ours_mc["acc"]
        assert results["tiny_mc"]["acc_norm,none"] == ours_mc["acc_norm"]


def run_lm_eval(model, model_args, tasks, out, cwd):
    """lm-eval's command line on the tasks in `tasks` (for `keras_mhf`,
    through our adapter's entry point, which registers the model):
    `(results, {task: per-example log-likelihoods, in document order})`."""
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
            "keras_mhf.evaluation.lm_eval_adapter"
            if model == "keras_mhf"
            else "lm_eval",
            "--model",
            model,
            "--model_args",
            model_args,
            "--batch_size",
            "2",
            "--tasks",
            "tiny_lambada,tiny_mc",
            "--include_path",
            str(tasks),
            "--output_path",
            str(out),
            "--log_samples",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=str(cwd),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    files = [
        os.path.join(root, f) for root, _, names in os.walk(out) for f in names
    ]
    results_file = next(
        f
        for f in files
        if os.path.basename(f).startswith("results") and f.endswith(".json")
    )
    results = json.load(open(results_file))["results"]
    samples = {}
    for task in ("tiny_lambada", "tiny_mc"):
        path = next(f for f in files if f"samples_{task}_" in f)
        docs = [json.loads(line) for line in open(path)]
        docs.sort(key=lambda d: d["doc_id"])
        samples[task] = [
            [float(r[0]) for r in d["filtered_resps"]] for d in docs
        ]
    return results, samples
