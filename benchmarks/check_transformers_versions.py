"""Loads a MultiHashFormer Hugging Face export with several `transformers`
releases and compares it with the Keras model.

The export needs only torch and transformers to load, so each release gets
its own small virtual environment (torch and the other shared packages are
installed once, in a `base` environment that each release's environment
reads through a `.pth` file). This script, run from the project's
environment:

1. exports two tiny MultiHashFormer models (random weights; one with linear
   RoPE scaling and a scoring temperature) and writes, from Keras, the
   reference numbers: token ids of a few texts, the log-probs at temperature
   1 and at the calibrated one, the mean next-token loss, and greedy tokens;
2. builds (or reuses) an environment per release in `--venvs` (outside the
   repository) and runs this same module there with `--probe FOLDER`, which
   imports only numpy, torch and transformers (and `benchmarks.common`,
   whose module level is the standard library);
3. writes every release's checks to `--output` (JSON): `supported` when
   all pass, `refused` when the modeling file refuses the release with its
   version message (releases older than its `MIN_TRANSFORMERS`), `failed`
   otherwise.

The checks per export: `AutoModelForCausalLM.from_pretrained(path,
trust_remote_code=True)` loads every tensor; `logits` equal the Keras
log-probs (1e-5), the calibrated ones with `apply_scoring_temperature=True`;
`labels=` gives the Keras loss; greedy `generate()` gives the Keras greedy
tokens and feeds one token per step after the prompt (the KV cache is used);
sampling runs; `save_pretrained` reloads to the same logits; without
`trust_remote_code` the folder is refused; `PreTrainedTokenizerFast` and
`AutoTokenizer` give the Keras token ids, and whether `AutoTokenizer` asked
for remote code is recorded (`transformers` 5 reads `config.json` first).

Usage:

    .venv/bin/python -m benchmarks.check_transformers_versions
    .venv/bin/python -m benchmarks.check_transformers_versions \
        --versions 4.56.2
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks import common

DEFAULT_VERSIONS = [
    "4.50.3",  # the last release without Qwen3: refused
    "4.51.0",  # the first with Qwen3; loads nothing without accelerate
    "4.51.1",
    "4.53.3",
    "4.56.2",
    "4.57.6",  # the last 4.x
    "5.0.0",
    "5.3.0",
    "5.10.4",
    "5.24.0",  # the project's pin
    "5.25.0",
]
DEFAULT_VENVS = os.path.join(
    os.path.expanduser("~"), ".cache", "keras_mhf", "transformers_venvs"
)
DEFAULT_OUTPUT = os.path.join(common.RESULTS, "transformers_versions.json")
SHARED_PACKAGES = ["numpy", "safetensors", "sentencepiece", "protobuf"]
TEXTS = ["The cell is the basic unit of life.", "Water  boils at 100 degrees."]
IDS = [[1, 5, 17, 33, 60, 2, 90, 41], [1, 7, 8, 9, 10, 11, 12, 13]]
PROMPT = [1, 5, 17]
NEW_TOKENS = 5
ATOL = 1e-5
EXPORTS = {
    # name: (backbone overrides, scoring temperature)
    "default_rope": ({}, 1.0),
    "linear_rope_calibrated": ({"rope_scaling_factor": 2.0}, 0.8),
}


# --- the probe: runs in a release's environment (numpy, torch, transformers)


def _capture_prompts():
    """Replaces `input` so that a prompt is recorded and answered as if no
    one were there (EOF), never waiting."""
    import builtins

    prompts = []

    def no_one_there(message=""):
        prompts.append(str(message))
        raise EOFError("no one at the terminal")

    builtins.input = no_one_there
    return prompts


def _tokenizer_checks(transformers, path, reference, prompts):
    checks = {}
    for name, load in (
        ("pretrained_tokenizer_fast", transformers.PreTrainedTokenizerFast),
        ("auto_tokenizer", transformers.AutoTokenizer),
    ):
        del prompts[:]
        try:
            tokenizer = load.from_pretrained(path)
            ids = [tokenizer(text)["input_ids"] for text in TEXTS]
            checks[name] = {
                "class": type(tokenizer).__name__,
                "same_ids": ids == reference["text_ids"],
                "asked_for_remote_code": bool(prompts),
            }
        except Exception as error:  # recorded, not fatal: the next check
            checks[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
    return checks


def _model_checks(transformers, torch, np, path, reference):
    import warnings

    checks = {}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, output_loading_info=True
    )
    checks["all_tensors_loaded"] = not any(
        info[key] for key in ("missing_keys", "unexpected_keys")
    )
    ids = torch.tensor(IDS, dtype=torch.long)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        logits = model(ids).logits.numpy()
        loss = float(model(ids, labels=ids).loss)
        lengths = []
        hook = model.register_forward_pre_hook(
            lambda module, args, kwargs: lengths.append(
                int(
                    (
                        kwargs["input_ids"]
                        if kwargs.get("input_ids") is not None
                        else args[0]
                    ).shape[1]
                )
            ),
            with_kwargs=True,
        )
        prompt = torch.tensor([PROMPT], dtype=torch.long)
        greedy = model.generate(
            prompt, max_new_tokens=NEW_TOKENS, do_sample=False
        )
        hook.remove()
        sampled = model.generate(
            prompt, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=5
        )
    paper_rule = np.asarray(reference["log_probs"])
    checks["logits_max_abs_diff"] = float(np.abs(logits - paper_rule).max())
    checks["logits_match"] = checks["logits_max_abs_diff"] <= ATOL
    checks["loss_matches"] = bool(
        np.isclose(loss, reference["loss"], rtol=1e-5, atol=0)
    )
    checks["greedy_matches"] = greedy[0].tolist() == reference["greedy"]
    checks["generate_uses_cache"] = lengths == [len(PROMPT)] + [1] * (
        NEW_TOKENS - 1
    )
    checks["sampling_runs"] = tuple(sampled.shape) == (
        1,
        len(PROMPT) + NEW_TOKENS,
    )
    checks["warnings_in_use"] = sorted({str(w.message)[:200] for w in caught})
    calibrated = transformers.AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, apply_scoring_temperature=True
    )
    with torch.no_grad():
        diff = np.abs(
            calibrated(ids).logits.numpy()
            - np.asarray(reference["calibrated_log_probs"])
        ).max()
    checks["calibrated_logits_match"] = bool(diff <= ATOL)
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)
        again = transformers.AutoModelForCausalLM.from_pretrained(
            saved, trust_remote_code=True
        )
        with torch.no_grad():
            checks["save_pretrained_round_trip"] = bool(
                np.array_equal(again(ids).logits.numpy(), logits)
            )
    try:
        transformers.AutoModelForCausalLM.from_pretrained(
            path, trust_remote_code=False
        )
        checks["refused_without_trust_remote_code"] = False
    except ValueError as error:
        checks["refused_without_trust_remote_code"] = (
            "trust_remote_code" in str(error)
        )
    return checks


def probe(path):
    """The checks of one export folder with the installed transformers (a
    dict; `model_error` holds the error that stopped the model checks)."""
    prompts = _capture_prompts()
    import numpy as np
    import torch
    import transformers

    with open(os.path.join(path, "keras_reference.json")) as f:
        reference = json.load(f)
    result = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    result.update(_tokenizer_checks(transformers, path, reference, prompts))
    try:
        result.update(_model_checks(transformers, torch, np, path, reference))
    except Exception as error:  # the release's failure is the result
        result["model_error"] = f"{type(error).__name__}: {error}"[:1000]
    return result


# --- the driver: runs in the project's environment (keras_mhf)


def export_models(directory):
    """Exports the `EXPORTS` models into `directory`, each folder with a
    `keras_reference.json` of the Keras model's numbers."""
    import keras
    import numpy as np

    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import MultiHashFormerTokenizer

    tokenizer = MultiHashFormerTokenizer(common.small_sentencepiece())
    folders = {}
    for name, (overrides, temperature) in EXPORTS.items():
        keras.utils.set_random_seed(0)
        lm = MultiHashFormerCausalLM.from_tokenizer(
            tokenizer,
            "tiny_h3b64",
            sequence_length=16,
            num_layers=2,
            **overrides,
        )
        lm.scoring_temperature = temperature
        folder = os.path.join(directory, name)
        lm.export_to_transformers(folder)
        ids = np.asarray(IDS, "int32")

        def log_probs(token_ids):
            return np.asarray(keras.ops.convert_to_numpy(lm.score(token_ids)))

        calibrated = log_probs(ids)
        lm.scoring_temperature = 1.0
        paper_rule = log_probs(ids)
        loss = -np.mean(
            np.take_along_axis(paper_rule[:, :-1], ids[:, 1:, None], -1)
        )
        greedy = list(PROMPT)
        for _ in range(NEW_TOKENS):
            step = log_probs(np.asarray([greedy], "int32"))
            greedy.append(int(step[0, -1].argmax()))
        text_ids = [
            [1] + [int(i) for i in keras.ops.convert_to_numpy(tokenizer(t))]
            for t in TEXTS
        ]
        reference = {
            "log_probs": paper_rule.tolist(),
            "calibrated_log_probs": calibrated.tolist(),
            "loss": float(loss),
            "greedy": greedy,
            "text_ids": text_ids,
        }
        with open(os.path.join(folder, "keras_reference.json"), "w") as f:
            json.dump(reference, f)
        folders[name] = folder
    return folders


def _run(command, log):
    with open(log, "a") as f:
        f.write("$ " + " ".join(command) + "\n")
        f.flush()
        return subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)


def _python(venv):
    return os.path.join(venv, "bin", "python")


def _site_packages(venv):
    output = subprocess.check_output(
        [
            _python(venv),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        text=True,
    )
    return output.strip()


def build_base(venvs, pip_args=()):
    """The environment that every release's environment shares: torch at
    the project environment's version, and the other packages an export
    needs besides transformers."""
    import torch

    base = os.path.join(venvs, "base")
    if not os.path.exists(_python(base)):
        subprocess.run([sys.executable, "-m", "venv", base], check=True)
    torch_version = torch.__version__.split("+")[0]
    check = subprocess.run(
        [_python(base), "-c", "import torch, numpy, safetensors"],
        capture_output=True,
    )
    if check.returncode != 0:
        result = _run(
            [_python(base), "-m", "pip", "install", "-q"]
            + [f"torch=={torch_version}"]
            + SHARED_PACKAGES
            + list(pip_args),
            os.path.join(venvs, "base.log"),
        )
        if result.returncode != 0:
            raise SystemExit(f"Installing the base environment failed: {venvs}")
    return base


def build_release(venvs, base, version):
    """The environment of one transformers release (`None`, with the pip
    log's path, when it cannot be installed)."""
    venv = os.path.join(venvs, f"transformers-{version}")
    log = venv + ".log"
    installed = (
        subprocess.run(
            [
                _python(venv),
                "-c",
                "import transformers; print(transformers.__version__)",
            ],
            capture_output=True,
            text=True,
        )
        if os.path.exists(_python(venv))
        else None
    )
    if installed is not None and installed.stdout.strip() == version:
        return venv, log
    subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
    with open(os.path.join(_site_packages(venv), "_shared_base.pth"), "w") as f:
        f.write(_site_packages(base) + "\n")
    result = _run(
        [
            _python(venv),
            "-m",
            "pip",
            "install",
            "-q",
            f"transformers=={version}",
        ],
        log,
    )
    return (venv if result.returncode == 0 else None), log


def run_probe(venv, folder):
    result = common.run_module(
        "check_transformers_versions",
        "--probe",
        os.path.abspath(folder),
        python=_python(venv),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": "", "TRANSFORMERS_VERBOSITY": "error"},
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        return {"probe_error": result.stderr[-2000:]}
    return json.loads(lines[-1])


def status(version, checks, minimum):
    """`supported`, `refused` (the modeling file's version message, for a
    release older than `minimum`) or `failed`, from the checks of every
    export of one release."""
    from packaging.version import Version

    message = f"needs transformers >= {minimum}"
    errors = [c.get("model_error", "") for c in checks.values()]
    if all(message in e and version in e for e in errors):
        return "refused" if Version(version) < Version(minimum) else "failed"
    for check in checks.values():
        if "model_error" in check or "probe_error" in check:
            return "failed"
        passed = [value for value in check.values() if isinstance(value, bool)]
        for tokenizer in ("pretrained_tokenizer_fast", "auto_tokenizer"):
            passed.append(check.get(tokenizer, {}).get("same_ids", False))
        passed.append(
            not check["pretrained_tokenizer_fast"]["asked_for_remote_code"]
        )
        if not all(passed):
            return "failed"
    return "supported"


def _minimum_version():
    path = os.path.join(
        common.ROOT,
        "keras_mhf",
        "export",
        "transformers",
        "modeling_multi_hash_former.py",
    )
    with open(path) as f:
        for line in f:
            if line.startswith("MIN_TRANSFORMERS = "):
                return line.split("=", 1)[1].strip().strip("\"'")
    raise SystemExit(f"No MIN_TRANSFORMERS in {path}")


def main(argv=None):
    parser = common.argument_parser("check_transformers_versions", __doc__)
    parser.add_argument("--versions", nargs="+", default=DEFAULT_VERSIONS)
    parser.add_argument(
        "--venvs",
        default=DEFAULT_VENVS,
        help="where the environments are built (outside the repository)",
    )
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument(
        "--pip-arg",
        action="append",
        default=[],
        help="an extra argument of the base environment's pip install "
        "(e.g. --pip-arg=--index-url=URL for CPU torch wheels)",
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe)))
        return 0
    venvs = os.path.abspath(args.venvs)
    if os.path.commonpath([venvs, common.ROOT]) == common.ROOT:
        raise SystemExit(f"--venvs must be outside the repository: {venvs}")
    os.makedirs(venvs, exist_ok=True)
    minimum = _minimum_version()
    results = {}
    with tempfile.TemporaryDirectory() as exports:
        folders = export_models(exports)
        base = build_base(venvs, args.pip_arg)
        for version in args.versions:
            venv, log = build_release(venvs, base, version)
            if venv is None:
                results[version] = {"status": "not installed", "log": log}
                print(f"transformers {version}: not installed (see {log})")
                continue
            checks = {name: run_probe(venv, f) for name, f in folders.items()}
            results[version] = {
                "status": status(version, checks, minimum),
                **checks,
            }
            print(f"transformers {version}: {results[version]['status']}")
    import torch

    report = {
        "what": "benchmarks.check_transformers_versions: a MultiHashFormer "
        "Hugging Face export loaded with each transformers release, checked "
        "against the Keras model",
        "min_transformers": minimum,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "exports": {
            name: {"backbone_overrides": o, "scoring_temperature": t}
            for name, (o, t) in EXPORTS.items()
        },
        "versions": results,
    }
    common.write_json(args.output, report)
    print(f"Wrote {args.output}")
    failed = [
        v
        for v, r in results.items()
        if r["status"] in ("failed", "not installed")
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
