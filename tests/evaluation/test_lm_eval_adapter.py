import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_mhf import evaluation
from tests.conftest import REPO
from tests.evaluation.harness_rows import squad_metrics_site
from tests.evaluation.harness_rows import write_lm_eval_tasks

pytest.importorskip("lm_eval")

# One process runs lm-eval on both models: our adapter on the preset, and
# lm-eval's own `hf` model on the Hugging Face export (its modeling code,
# trust_remote_code; `<s>` first, as keras_mhf scores every context).
# logits_cache=False: with it, lm-eval's `hf` model reuses one request's
# logits for another whose tokens but the last are the same, and slices
# them with the first one's continuation length, so a LAMBADA passage and a
# question of the same text split elsewhere ("The cell is the basic unit
# of" + " life", "The cell is" + " the basic unit of life") got -18.91
# instead of -19.55 (lm-eval 0.4.13; the case of lm-eval issue #2984).
LM_EVAL_SCRIPT = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
import lm_eval.models  # registers `hf`
import keras_mhf.evaluation.lm_eval_adapter  # registers `keras_mhf`

definitions, runs, tasks, out = sys.argv[1:]
manager = TaskManager(include_path=definitions)
found = {}
for model, model_args in json.loads(runs):
    result = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks.split(","),
        task_manager=manager,
        batch_size=2,
        device="cpu",
        log_samples=True,
    )
    found[model] = {
        "results": result["results"],
        "samples": {
            task: [
                [float(r[0]) for r in d["filtered_resps"]]
                for d in sorted(samples, key=lambda d: d["doc_id"])
            ]
            for task, samples in result["samples"].items()
        },
    }
json.dump(found, open(out, "w"))
"""

# Our metric name -> lm-eval's.
LM_EVAL_METRICS = {
    "acc": "acc,none",
    "acc_norm": "acc_norm,none",
    "perplexity": "perplexity,none",
    "f1": "f1,none",
    "em": "em,none",
}


def test_lm_eval_agrees_with_us_on_the_ten_tasks(tiny_lm, tmp_path):
    """lm-eval's own task definitions of the paper's ten tasks, run by
    lm-eval on our adapter and by its `hf` model on the export, give the
    per-example log-likelihoods (1e-4) and the metrics of `keras-mhf
    evaluate --task` on the same rows."""
    preset = str(tmp_path / "preset")
    tiny_lm.save_to_preset(preset)
    hf = str(tmp_path / "hf")
    tiny_lm.export_to_transformers(hf)
    definitions, files = write_lm_eval_tasks(str(tmp_path))
    output = tmp_path / "ours.jsonl"
    ours = evaluation.evaluate_preset(
        preset, tasks=list(files.items()), output=str(output)
    )
    records = {}
    for line in output.read_text().splitlines()[1:]:
        line = json.loads(line)
        if "index" in line:
            lls = line.get("loglikelihoods", [line.get("loglikelihood")])
            records.setdefault(line["task"], {})[line["index"]] = lls
    runs = [
        ("keras_mhf", f"preset={preset}"),
        (
            "hf",
            f"pretrained={hf},trust_remote_code=True,add_bos_token=True,"
            "logits_cache=False",
        ),
    ]
    found = run_lm_eval(definitions, runs, list(files), tmp_path)
    for model, _ in runs:
        for name, path in files.items():
            task = f"local_{name}"
            samples = found[model]["samples"][task]
            assert len(samples) == len(records[name])
            for index, lls in enumerate(samples):
                np.testing.assert_allclose(
                    lls,
                    records[name][index],
                    atol=1e-4,
                    rtol=0,
                    err_msg=f"{model} {name} row {index}",
                )
            metrics = ours[f"{name}:{path}"]
            for metric, value in metrics.items():
                if metric in LM_EVAL_METRICS:
                    np.testing.assert_allclose(
                        found[model]["results"][task][LM_EVAL_METRICS[metric]],
                        value,
                        rtol=1e-4,
                        err_msg=f"{model} {name} {metric}",
                    )


def run_lm_eval(definitions, runs, names, tmp_path):
    """lm-eval on the local task definitions for each `(model,
    model_args)`, in one process: `{model: {"results", "samples": {task:
    per-example log-likelihoods, in document order}}}`."""
    out = tmp_path / "lm_eval.json"
    env = dict(
        os.environ,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        # sitecustomize: lm-eval's ReCoRD needs a module transformers 5
        # dropped (see install_squad_metrics).
        PYTHONPATH=os.pathsep.join(
            [squad_metrics_site(str(tmp_path / "site")), str(REPO)]
        ),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            LM_EVAL_SCRIPT,
            definitions,
            json.dumps(runs),
            ",".join(f"local_{n}" for n in names),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())
