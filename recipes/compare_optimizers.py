"""Before/after table of a change of optimizer in the replication harness
(`recipes/replicate.py`): Keras' AdamW (epsilon before bias correction, our
runs before 0.2) against the authors' AdamW (epsilon after it,
`keras_mhf.optimizers.BiasCorrectedAdamW`), per model, mean ± std over the
seeds both runs have, and the update sizes of the weight groups that
`replicate.py` records.

    python recipes/compare_optimizers.py \
        --before recipes/results/keras_adamw_rerun \
        --after recipes/results/authors_adamw \
        --earlier recipes/results/seeds \
        --output recipes/results/authors_adamw/comparison.md

`--before` and `--after` are runs of the same code with `--optimizer
keras_adamw` and `adamw` (results folders, each given once or more: their
runs are pooled, a (seed, model) pair taken from the first folder that has
it; `FOLDER:MODEL,MODEL` takes only those models' runs from a folder, e.g.
`recipes/results/seeds:standard,single_id_h1x4b16384` for the models whose
0.1 runs the current code reproduces); `--earlier` adds the committed results of an earlier
release, labelled as such (the code has changed since, so its numbers are
not the "before" arm).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from replicate import _fmt  # noqa: E402

# (column, value of a run, digits)
METRICS = (
    (
        "perplexity (paper rule)",
        lambda r: r["validation_paper_rule"]["perplexity"],
        1,
    ),
    (
        "perplexity (calibrated)",
        lambda r: r["validation"]["perplexity"] if r["calibrated"] else None,
        1,
    ),
    ("next-token acc", lambda r: r["validation"]["accuracy"], 3),
    ("temperature", lambda r: r["scoring_temperature"], 2),
)
GROUPS = ("gate scorer", "mixers' first layers", "mixers (other weights)")
UPDATE_STEPS = ("2", "3", "5", "10", "20", "50", "100", "250")


def load(folder):
    """The runs of a results folder, `FOLDER:MODEL,...` keeping only those
    models'."""
    folder, _, models = folder.partition(":")
    with open(os.path.join(folder, "results.json")) as f:
        runs = json.load(f)["runs"]
    wanted = set(models.split(",")) if models else None
    return [r for r in runs if wanted is None or r["model"] in wanted]


def pooled(folders):
    """The runs of several folders, each (seed, model) from the first folder
    that has it, in seed order."""
    runs = {}
    for folder in folders:
        for r in load(folder):
            runs.setdefault((r["seed"], r["model"]), r)
    return [runs[key] for key in sorted(runs, key=lambda k: k[0])]


def _cell(runs, value, digits):
    values = [value(r) for r in runs]
    if not values or any(v is None for v in values):
        return "—"
    return _fmt(values, digits)


def metrics_table(arms):
    """One row per model and arm (`[(label, runs)]`, the first arm's
    models in order): the metrics, mean ± std over each arm's seeds."""
    models = list(dict.fromkeys(r["model"] for r in arms[-1][1]))
    lines = [
        "| model | optimizer (runs) | "
        + " | ".join(name for name, _, _ in METRICS)
        + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for model in models:
        for label, runs in arms:
            rs = [r for r in runs if r["model"] == model]
            if not rs:
                continue
            seeds = ("seeds " if len(rs) > 1 else "seed ") + ", ".join(
                str(r["seed"]) for r in rs
            )
            cells = [_cell(rs, value, digits) for _, value, digits in METRICS]
            lines.append(
                f"| {model} | {label} ({seeds}) | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n\nMean ± sample std over the seeds named.\n"


def updates_table(before, after, model="mhf_h4b16384", seed=0):
    """Relative update sizes ||W_t - W_(t-1)|| / ||W_(t-1)|| of one run
    before and after, at the recorded steps."""
    lines = [
        "| weights | optimizer | "
        + " | ".join(f"step {s}" for s in UPDATE_STEPS)
        + " |",
        "|---|---|" + "---|" * len(UPDATE_STEPS),
    ]
    for group in GROUPS:
        for label, runs in (("Keras", before), ("authors'", after)):
            run = next(
                r for r in runs if r["model"] == model and r["seed"] == seed
            )
            sizes = run["update_sizes"].get(group, {})
            cells = [
                f"{sizes[s]:.2e}" if s in sizes else "—" for s in UPDATE_STEPS
            ]
            lines.append(f"| {group} | {label} | " + " | ".join(cells) + " |")
    return (
        "\n".join(lines)
        + f"\n\n{model}, seed {seed}: relative update size of each group "
        "(Frobenius norms over the group) at the step named.\n"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--before", action="append", required=True, help="Keras AdamW runs"
    )
    p.add_argument(
        "--after", action="append", required=True, help="authors' AdamW runs"
    )
    p.add_argument(
        "--earlier", default=None, help="committed results of a release"
    )
    p.add_argument("--output", required=True, help="the markdown file")
    args = p.parse_args(argv)
    before = pooled(args.before)
    after = pooled(args.after)
    arms = [("Keras AdamW", before), ("authors' AdamW", after)]
    if args.earlier:
        arms.insert(
            0, ("Keras AdamW, 0.1's committed runs", load(args.earlier))
        )
    sources = (
        "\n".join(
            f"- {label}: " + ", ".join(f"`{f}`" for f in folders)
            for label, folders in (
                ("Keras AdamW", args.before),
                ("authors' AdamW", args.after),
            )
        )
        + "\n\n(`FOLDER:MODEL,...`: only those models' runs; each (seed, "
        "model) comes from the first folder that has it.)\n"
    )
    text = (
        "# Keras' AdamW against the authors' AdamW\n\n"
        + metrics_table(arms)
        + "\nRuns of each arm:\n\n"
        + sources
        + "\n"
        + updates_table(before, after)
    )
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
