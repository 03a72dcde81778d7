"""bf16 against float32 (issue #39, item 3): 200 steps of `mini_h4b1024` on
the quickstart corpus (Python's bundled documentation, as `keras-mhf
quickstart` splits it) at `--precision float32`, `mixed_bfloat16` and
`bfloat16`, on each backend, each in a fresh process; reports each bf16
curve's largest and mean relative gap to float32's per-step training loss
(the first 20 steps, where the loss falls fastest, separately from the rest)
and the final validation loss (paper's rule).

    python -m benchmarks.precision_curves \
        --out benchmarks/results/precision_curves
    python -m benchmarks.precision_curves --backends jax --steps 50  # quicker

The corpus is prepared once (tokenizer, token shards) and shared by every
run, so all runs read the same windows in the same order.
"""

import argparse
import os
import shutil
import sys
import tempfile

import numpy as np

from benchmarks import common

PRECISIONS = ("float32", "mixed_bfloat16", "bfloat16")
BACKENDS = ("jax", "tensorflow", "torch")
SETTINGS = dict(
    architecture="mini_h4b1024",
    sequence_length=128,
    batch_size=8,
    learning_rate=2e-3,
    warmup_steps=20,
    seed=0,
    verbose=0,
)
EARLY = 20  # steps where the loss falls fastest (reported apart)


def prepare(workdir):
    """The quickstart's training and validation slices, prepared once with
    a tokenizer trained on the training slice (as `pretrain` does)."""
    from keras_mhf.cli import quickstart
    from keras_mhf.data import prepare_data
    from keras_mhf.data import read_documents
    from keras_mhf.pretraining.data import tokenizer_training_sample
    from keras_mhf.pretraining.data import train_sentencepiece

    os.makedirs(workdir, exist_ok=True)
    args = quickstart.build_parser().parse_args(["--output", workdir])
    train, validation, _ = quickstart.split_corpus(args)
    tokenizer = train_sentencepiece(
        tokenizer_training_sample(read_documents(train)),
        args.vocabulary_size,
        os.path.join(workdir, "tokenizer.model"),
    )
    prepare_data(
        train,
        tokenizer,
        os.path.join(workdir, "prepared"),
        validation_inputs=validation,
        workers=1,
        progress=False,
    )


def step_losses(record):
    """Each step's own loss from Keras' running means `(batch, mean)` of
    each `fit` call (a chunk): `k * mean_k - (k - 1) * mean_(k-1)`."""
    losses, previous = [], 0.0
    for batch, mean in record:
        count = batch + 1
        losses.append(count * mean - (count - 1) * previous if batch else mean)
        previous = mean
    return losses


def train(workdir, precision, steps):
    """One run in this process; prints its losses as a RESULT line."""
    import keras

    from keras_mhf.pretraining import pretrain

    record = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            record.append((batch, float(np.asarray((logs or {})["loss"]))))

    output = os.path.join(workdir, f"{keras.config.backend()}_{precision}")
    shutil.rmtree(output, ignore_errors=True)  # a fresh run, every step
    _, summary = pretrain(
        os.path.join(workdir, "prepared"),
        output,
        tokenizer=os.path.join(workdir, "tokenizer.model"),
        precision=precision,
        steps=steps,
        checkpoint_every=max(steps // 4, 1),
        callbacks=[Record()],
        **SETTINGS,
    )
    result = dict(
        losses=step_losses(record),
        validation=summary.get("validation_paper_rule", summary["validation"])[
            "loss"
        ],
    )
    common.print_result(result)


def gaps(curve, reference):
    """Relative gaps of a loss curve to float32's: `(early max, late max,
    late mean)`."""
    curve, reference = np.asarray(curve), np.asarray(reference)
    relative = np.abs(curve - reference) / np.abs(reference)
    return (
        float(relative[:EARLY].max()),
        float(relative[EARLY:].max()),
        float(relative[EARLY:].mean()),
    )


def format_table(results, steps):
    lines = [
        f"# bf16 vs float32: {steps} steps of {SETTINGS['architecture']} on "
        "the quickstart corpus",
        "",
        "Written by `python -m benchmarks.precision_curves`. Relative gap = "
        "|loss "
        "- float32's loss| / float32's loss at the same step (same windows, "
        f"same seed); the first {EARLY} steps are reported apart. Validation "
        "is the final model's loss on the validation windows (paper's rule).",
        "",
        "| backend | precision | final train loss | validation loss | max "
        f"gap, steps 1-{EARLY} | max gap, steps {EARLY + 1}-{steps} | mean "
        f"gap, steps {EARLY + 1}-{steps} | finite |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend, runs in results.items():
        reference = runs.get("float32")
        for precision, run in runs.items():
            if "failed" in run:
                lines.append(
                    f"| {backend} | {precision} | failed: {run['failed']} |||||"
                )
                continue
            losses = run["losses"]
            if precision == "float32" or reference is None:
                shown = ("-", "-", "-")
            else:
                shown = tuple(
                    f"{g:.2%}" for g in gaps(losses, reference["losses"])
                )
            lines.append(
                f"| {backend} | {precision} | {losses[-1]:.4f} | "
                f"{run['validation']:.4f} | "
                + " | ".join(shown)
                + f" | {bool(np.all(np.isfinite(losses)))} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = common.argument_parser("precision_curves", __doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="writes OUT.json and OUT.md")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    workdir = os.path.abspath(
        args.workdir or tempfile.mkdtemp(prefix="precision_curves_")
    )
    if args.worker:
        return train(workdir, args.worker, args.steps)
    if not os.path.exists(os.path.join(workdir, "prepared", "index.json")):
        prepare(workdir)
    results = {}
    for backend in args.backends:
        results[backend] = {}
        for precision in args.precisions:
            done = common.run_module(
                "precision_curves",
                "--worker",
                precision,
                "--steps",
                args.steps,
                "--workdir",
                workdir,
                capture_output=True,
                text=True,
                env=dict(os.environ, KERAS_BACKEND=backend),
            )
            found = common.results_in(done.stdout)
            if found:
                run = found[-1]
            else:
                print(done.stderr[-3000:], file=sys.stderr)
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                run = dict(failed=last[:200])
            results[backend][precision] = run
            print(
                backend,
                precision,
                {k: v for k, v in run.items() if k != "losses"},
                flush=True,
            )
            if args.out:
                common.write_json(
                    args.out + ".json",
                    dict(steps=args.steps, results=results),
                    indent=None,
                )
                with open(args.out + ".md", "w") as f:
                    f.write(format_table(results, args.steps))
    print(format_table(results, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
