"""Reproduce the paper's key comparisons at small scale, on real text, with one
command (paper Tables 1 and 3, Sec. 5-6).

    python recipes/replicate.py --output recipes/results     # the committed run
    python recipes/replicate.py --output runs/rep --seeds 3  # mean +- std
    python recipes/replicate.py --output /tmp/smoke --smoke  # seconds, for CI

Trains, with the same data order, token budget, optimizer, schedule and trunk:
Standard; Standard+kL (k so that its parameters match MHF H4's, as the paper's
parameter-matched baseline); MHF H3 with B chosen so its embedding parameters
match Standard's; MHF H4 B16384; the single-ID ablation at H4's parameter
budget (one authors'-rule hash id repeated in all four heads, paper Table 3);
and, only when asked for (`--models mhf_lsh1`), the LSH ablation (paper Sec. 6,
"MMH3 vs. LSH"): H4 B16384 whose first head is the authors' LSH id of the
token's character trigrams (`num_lsh=1`; needs PyTorch).
Every MHF model is calibrated at the end of its run (`keras-mhf pretrain`'s
default): its scoring temperature is fit on the first half of the validation
windows. It reports on the second half (held out from that fit, the same
windows for every model): perplexity over the real vocabulary under the
paper's rule and calibrated, the temperature, expected calibration error
(paper's rule / calibrated), next-token top-1 accuracy, last-word
(LAMBADA-style) accuracy on held-out passages, parameters (embedding / decoder
/ total), training tokens and wall time; writes results.md, results.json and
val_loss.png (validation loss against training tokens, paper's rule).
The Standard baseline has one scoring rule (the softmax of its logits): its
numbers are in the paper-rule columns and its calibrated columns are "—".
"""

import argparse
import contextlib
import glob
import json
import os
import re
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
# Share of documents held out when --data has no validation files.
VALIDATION_FRACTION = 0.05


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--data",
        default=os.path.join(DATA, "openstax_edu_en"),
        help="folder with train*/validation* .jsonl|.txt files, or one file "
        "(5%% of its documents, chosen by a hash of their text, are held "
        "out)",
    )
    p.add_argument(
        "--tokenizer",
        default=os.path.join(DATA, "mistral_v03_tokenizer", "tokenizer.model"),
    )
    p.add_argument("--output", required=True)
    p.add_argument(
        "--trunk", default="mini", help="trunk shared by every model"
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        help="steps between evaluations",
    )
    p.add_argument("--validation-blocks", type=int, default=64)
    p.add_argument("--last-word-passages", type=int, default=200)
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="seeds 0..N-1; N > 1 reports mean +- std",
    )
    p.add_argument(
        "--models",
        nargs="*",
        default=None,
        help="subset of: standard standard+kL mhf_h3 mhf_h4 single_id "
        "mhf_lsh1 (the LSH ablation; run only when named), or model names "
        "such as mhf_h4b16384 mhf_lsh1_h4b16384",
    )
    p.add_argument(
        "--work-dir",
        default=None,
        help="the prepared training corpus (WORK_DIR/data, shared by every "
        "run, so all models see identical data), checkpoints and presets of "
        "every run (default: OUTPUT/runs); OUTPUT keeps only the report, the "
        "plot and the training logs",
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "keras_adamw"),
        default="adamw",
        help="adamw: epsilon after bias correction (torch, the authors); "
        "keras_adamw: Keras' AdamW, as the results before 0.2 were made",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny trunk, tiny budget: checks the pipeline in seconds",
    )
    return p.parse_args(argv)


def split_data(data):
    if os.path.isdir(data):
        train = sorted(glob.glob(os.path.join(data, "train*")))
        validation = sorted(glob.glob(os.path.join(data, "validation*")))
        if train and validation:
            return train, validation
    return data, None


def model_specs(trunk, vocabulary_size, smoke=False):
    """The compared models: (name, kind, architecture, extra_layers, rule)."""
    from keras_mhf.models import count_parameters

    h4_buckets = 256 if smoke else 16384
    standard = count_parameters(trunk, vocabulary_size)
    h4 = count_parameters(f"{trunk}_h4b{h4_buckets}", vocabulary_size)
    layer = (
        count_parameters(trunk, vocabulary_size, extra_layers=1)["total"]
        - standard["total"]
    )
    k = max(1, int(round((h4["total"] - standard["total"]) / layer)))
    # H3: B so that the hash interface has about Standard's embedding
    # parameters.
    best = _solve_h3(trunk, vocabulary_size, standard["total"])
    return [
        ("standard", "standard", trunk, 0, "unique"),
        (f"standard+{k}L", "standard", trunk, k, "unique"),
        (f"mhf_h3b{best}", "mhf", f"{trunk}_h3b{best}", 0, "unique"),
        (
            f"mhf_h4b{h4_buckets}",
            "mhf",
            f"{trunk}_h4b{h4_buckets}",
            0,
            "unique",
        ),
        (
            f"single_id_h1x4b{h4_buckets}",
            "mhf",
            f"{trunk}_h4b{h4_buckets}",
            0,
            "repeated",
        ),
        (
            f"mhf_lsh1_h4b{h4_buckets}",
            "mhf",
            f"{trunk}_h4b{h4_buckets}_lsh1",
            0,
            "unique",
        ),
    ]


# Groups that run only when `--models` names them.
OPT_IN = ("mhf_lsh1",)


def _solve_h3(trunk, vocabulary_size, target):
    from keras_mhf.models import count_parameters

    low, high = 2, 4 * vocabulary_size
    while low < high:
        mid = (low + high) // 2
        if (
            count_parameters(f"{trunk}_h3b{mid}", vocabulary_size)["total"]
            < target
        ):
            low = mid + 1
        else:
            high = mid
    candidates = [low - 1, low]
    return min(
        candidates,
        key=lambda b: abs(
            count_parameters(f"{trunk}_h3b{b}", vocabulary_size)["total"]
            - target
        ),
    )


def _group(name):
    for prefix in (
        "standard+",
        "mhf_h3",
        "mhf_h4",
        "mhf_lsh1",
        "single_id",
        "standard",
    ):
        if name.startswith(prefix):
            return {
                "standard+": "standard+kL",
                "mhf_h3": "mhf_h3",
                "mhf_h4": "mhf_h4",
                "mhf_lsh1": "mhf_lsh1",
                "single_id": "single_id",
                "standard": "standard",
            }[prefix]
    return name


def replicate(
    data,
    tokenizer,
    output,
    trunk="mini",
    steps=300,
    batch_size=8,
    sequence_length=128,
    learning_rate=2e-3,
    checkpoint_every=100,
    validation_blocks=64,
    last_word_passages=200,
    seeds=1,
    models=None,
    smoke=False,
    work_dir=None,
    verbose=1,
    optimizer="adamw",
):
    """Runs the comparison; returns the results dict (also written to disk)."""
    import keras

    from keras_mhf import evaluation
    from keras_mhf.data import prepare_data
    from keras_mhf.data import read_documents
    from keras_mhf.data import validation_score
    from keras_mhf.models import MultiHashFormerTokenizer
    from keras_mhf.models import count_parameters
    from keras_mhf.pretraining import pretrain
    from keras_mhf.utils.files import write_json

    if smoke:
        trunk, steps, checkpoint_every = "tiny", 2, 1
        validation_blocks, last_word_passages = 4, 4
    os.makedirs(output, exist_ok=True)
    train, validation = split_data(data)
    vocabulary_size = MultiHashFormerTokenizer(tokenizer).vocabulary_size()
    specs = model_specs(trunk, vocabulary_size, smoke)
    if models:
        specs = [s for s in specs if _group(s[0]) in models or s[0] in models]
    else:
        specs = [s for s in specs if _group(s[0]) not in OPT_IN]
    if validation:
        held_out = list(read_documents(validation))
    else:  # the documents prepare_data holds out (validation_score rule)
        held_out = [
            d
            for d in read_documents(train)
            if validation_score(d) < VALIDATION_FRACTION
        ]
    # Derived from the data, so it stays with the runs, not in the report
    # folder.
    work_dir = work_dir or os.path.join(output, "runs")
    os.makedirs(work_dir, exist_ok=True)
    # Tokenized once; every run streams the same windows from it.
    prepared = os.path.join(work_dir, "data")
    prepare_data(
        train,
        tokenizer,
        prepared,
        validation_fraction=VALIDATION_FRACTION,
        validation_inputs=validation,
        progress=bool(verbose),
    )
    last_word_path = evaluation.write_last_word_file(
        held_out,
        os.path.join(work_dir, "last_word_passages.jsonl"),
        count=last_word_passages,
    )

    config = dict(
        trunk=trunk,
        steps=steps,
        batch_size=batch_size,
        sequence_length=sequence_length,
        learning_rate=learning_rate,
        seeds=seeds,
        optimizer=optimizer,
        tokenizer=os.path.basename(tokenizer),
        data=str(data),
    )
    finished = _finished_runs(os.path.join(output, "results.json"), config)
    runs = []
    for seed in range(seeds):
        for name, kind, architecture, extra_layers, rule in specs:
            if (seed, name) in finished:
                # Same settings, already measured: a rerun with more seeds
                # (or after a crash) adds only the missing runs.
                if verbose:
                    print(f"=== seed {seed}: {name}: kept from results.json")
                runs.append(finished[(seed, name)])
                continue
            if verbose:
                print(f"\n=== seed {seed}: {name} ===", flush=True)
            keras.config.set_dtype_policy("float32")
            started = time.time()
            run_dir = os.path.join(work_dir, f"seed{seed}", name)
            updates = UpdateSizes(steps)
            with updates.recording():
                lm, summary = pretrain(
                    prepared,
                    run_dir,
                    tokenizer=tokenizer,
                    model=kind,
                    architecture=architecture,
                    extra_layers=extra_layers,
                    signature_rule=rule,
                    sequence_length=sequence_length,
                    batch_size=batch_size,
                    steps=steps,
                    learning_rate=learning_rate,
                    warmup_steps=max(1, steps // 10),
                    validation_blocks=validation_blocks,
                    checkpoint_every=checkpoint_every,
                    seed=seed,
                    optimizer=optimizer,
                    verbose=0 if smoke else verbose,
                )
            last_word, _ = evaluation.lambada(
                lm, lm.preprocessor.tokenizer, last_word_path, batch_size
            )
            counted = count_parameters(
                architecture, vocabulary_size, extra_layers
            )
            os.makedirs(os.path.join(output, "logs"), exist_ok=True)
            log_copy = os.path.join(output, "logs", f"seed{seed}_{name}.csv")
            with open(summary["log"]) as src, open(log_copy, "w") as dst:
                dst.write(src.read())
            runs.append(
                {
                    "seed": seed,
                    "model": name,
                    "group": _group(name),
                    "architecture": architecture,
                    "extra_layers": extra_layers,
                    "signature_rule": rule,
                    "parameters": {
                        k: counted[k]
                        for k in ("embedding", "decoder", "trunk", "total")
                    },
                    # The model's final rule: calibrated for MHF (unless the
                    # fit was skipped), the only rule for Standard.
                    "validation": summary["validation"],
                    # Standard has one rule: the same numbers.
                    "validation_paper_rule": summary.get(
                        "validation_paper_rule", summary["validation"]
                    ),
                    "calibrated": summary["calibration"]["applied"],
                    "scoring_temperature": summary["scoring_temperature"],
                    "validation_windows": summary["validation_windows"],
                    "last_word": last_word,
                    "train_tokens": steps * batch_size * sequence_length,
                    "seconds": round(time.time() - started, 1),
                    # Relative update size per group of weights at chosen
                    # steps: ||W_t - W_(t-1)|| / ||W_(t-1)||.
                    "update_sizes": updates.sizes,
                    "log": os.path.relpath(log_copy, output),
                }
            )
            write_json(
                os.path.join(output, "results.json"),
                {"config": config, "runs": runs},
                indent=2,
            )
    with open(os.path.join(output, "results.md"), "w") as f:
        f.write(markdown(runs, seeds))
    plot(runs, os.path.join(output, "val_loss.png"))
    return runs


def _finished_runs(path, config):
    """{(seed, model): run} of a results.json written with the same settings
    (the number of seeds aside); {} when there is none or settings differ."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        earlier = json.load(f)
    same = {k: v for k, v in earlier.get("config", {}).items() if k != "seeds"}
    wanted = {k: v for k, v in config.items() if k != "seeds"}
    if same != wanted:
        return {}
    return {(r["seed"], r["model"]): r for r in earlier.get("runs", [])}


# Groups of weights whose update sizes a run records (paths matched in order;
# a weight joins the first group it matches).
UPDATE_GROUPS = (
    ("gate scorer", r"hash_encoder/(gate|score)_dense/"),
    ("encoder output", r"hash_encoder/output_dense/"),
    ("bucket tables", r"hash_encoder/embeddings_"),
    ("mixers' first layers", r"hash_decoder/mixer_\d+_down_dense/kernel"),
    ("mixers (other weights)", r"hash_decoder/mixer_"),
    ("output heads", r"hash_decoder/"),
    ("token embedding", r"token_embedding/"),
    ("trunk", r"transformer_layer_|sequence_output_layernorm"),
)
UPDATE_STEPS = (2, 3, 5, 10, 20, 50, 100, 150, 200, 250)


class UpdateSizes:
    """Records, at `UPDATE_STEPS`, each weight group's relative update
    ||W_t - W_(t-1)|| / ||W_(t-1)|| (Frobenius norms over the group), from
    the pre-training run's `"train_step"` hook. `sizes`:
    `{group: {step: size}}`."""

    def __init__(self, steps):
        self.steps = [t for t in UPDATE_STEPS if t <= steps]
        self.sizes = {}
        self._before = None

    def _groups(self, model):
        import keras

        groups = {}
        for variable in model.trainable_variables:
            for name, pattern in UPDATE_GROUPS:
                if re.search(pattern, variable.path):
                    value = keras.ops.convert_to_numpy(variable.value)
                    groups.setdefault(name, []).append(
                        value.astype("float64").ravel()
                    )
                    break
        return {k: np.concatenate(v) for k, v in groups.items()}

    def event(self, name, **info):
        if name != "train_step":
            return
        step = info["step"]
        if step not in self.steps and step + 1 not in self.steps:
            return
        now = self._groups(info["callback"].model)
        if step in self.steps and self._before is not None:
            for group, old in self._before.items():
                size = np.linalg.norm(now[group] - old) / np.linalg.norm(old)
                self.sizes.setdefault(group, {})[str(step)] = float(size)
        # Steps 2 and 3 are both recorded: step 2's weights are step 3's
        # "before".
        self._before = now if step + 1 in self.steps else None

    @contextlib.contextmanager
    def recording(self):
        """Records while the `with` block runs (the hooks chain)."""
        from keras_mhf.utils import hooks

        original = hooks.event

        def event(name, **info):
            original(name, **info)
            self.event(name, **info)

        hooks.event = event
        try:
            yield self
        finally:
            hooks.event = original


def _fmt(values, digits):
    values = np.asarray(values, "float64")
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"


NOT_CALIBRATED = "—"


def _calibrated(rs, values, digits):
    """`_fmt` of the calibrated numbers, or "—" when a run of the model was
    not calibrated (Standard, or an MHF fit that was skipped)."""
    if not all(r["calibrated"] for r in rs):
        return NOT_CALIBRATED
    return _fmt([values(r) for r in rs], digits)


def markdown(runs, seeds):
    """The results table (one row per model; mean ± std over seeds) and
    notes on what its columns hold."""
    names = list(dict.fromkeys(r["model"] for r in runs))
    lines = [
        "| model | embedding | decoder | total params | "
        "val perplexity (paper rule) | val perplexity (calibrated) | "
        "temperature | ECE (paper rule / calibrated) | next-token acc | "
        "last-word acc | train tokens | wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        rs = [r for r in runs if r["model"] == name]
        p = rs[0]["parameters"]
        paper = [r["validation_paper_rule"] for r in rs]
        paper_perplexity = _fmt([m["perplexity"] for m in paper], 1)
        paper_ece = _fmt([m["ece"] for m in paper], 3)
        perplexity = _calibrated(rs, lambda r: r["validation"]["perplexity"], 1)
        ece = _calibrated(rs, lambda r: r["validation"]["ece"], 3)
        temperature = _calibrated(rs, lambda r: r["scoring_temperature"], 2)
        lines.append(
            f"| {name} | {p['embedding'] / 1e6:.2f}M | "
            f"{p['decoder'] / 1e6:.3f}M | "
            f"{p['total'] / 1e6:.2f}M | "
            f"{paper_perplexity} | {perplexity} | {temperature} | "
            f"{paper_ece} / {ece} | "
            f"{_fmt([r['validation']['accuracy'] for r in rs], 3)} | "
            f"{_fmt([r['last_word']['acc'] for r in rs], 3)} | "
            f"{rs[0]['train_tokens']:,} | "
            f"{_fmt([r['seconds'] for r in rs], 0)} |"
        )
    windows = runs[0]["validation_windows"]
    fit, reported = windows["calibration_fit"], windows["reported"]
    note = (
        f"Validation: windows {reported[0]}..{reported[1] - 1} of "
        f"{windows['windows']} held-out windows of "
        f"{windows['sequence_length']} tokens, the same for every model; "
        "each MHF model's scoring temperature was fit on windows "
        f"{fit[0]}..{fit[1] - 1}, so its calibrated numbers are held out "
        "from the fit. Paper rule: the sum of the heads' log-probs, "
        "renormalised over the vocabulary (temperature 1). The Standard "
        "baseline has one scoring rule (the softmax of its logits), shown "
        f"in the paper-rule columns; {NOT_CALIBRATED} marks numbers that do "
        "not exist (not calibrated). Calibration changes neither next-token "
        "nor last-word accuracy (greedy choices are the same).\n\nSeeds: "
        + ", ".join(str(s) for s in sorted({r["seed"] for r in runs}))
    )
    if seeds > 1:
        note += " (mean ± sample std over seeds)"
    return "\n".join(lines) + f"\n\n{note}.\n"


def plot(runs, path):
    import csv

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["model"] for r in runs):
        curves = []
        for r in (r for r in runs if r["model"] == name):
            with open(os.path.join(os.path.dirname(path), r["log"])) as f:
                rows = list(csv.DictReader(f))
            curves.append(
                (
                    [int(x["tokens"]) for x in rows],
                    [float(x["val_loss"]) for x in rows],
                )
            )
        tokens = curves[0][0]
        mean = np.mean([c[1] for c in curves], 0)
        ax.plot(tokens, mean, "o-", label=name)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation NLL per token (nats, paper rule)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse_args(argv)
    runs = replicate(
        args.data,
        args.tokenizer,
        args.output,
        args.trunk,
        args.steps,
        args.batch_size,
        args.sequence_length,
        args.learning_rate,
        args.checkpoint_every,
        args.validation_blocks,
        args.last_word_passages,
        args.seeds,
        args.models,
        args.smoke,
        args.work_dir,
        optimizer=args.optimizer,
    )
    print(markdown(runs, args.seeds))


if __name__ == "__main__":
    main()
