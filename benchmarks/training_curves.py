"""Draws docs/images/tensorboard_curves.png: the TensorBoard curves of a
small run that is stopped part way and resumed, read back with
TensorBoard's own reader (`EventAccumulator`) and drawn with matplotlib.

The run: `mini_h4b1024` on the OpenStax sample (`tests/testdata`), 200
steps of 8 windows of 128 tokens, checkpoints every 50 steps, a point every
10; a hook stops it at step 130 (after its points for 110-130 are written,
past the checkpoint at 100), and the same call is made again to resume.
Each step must be on the curves once: the script checks it and prints the
points.

    python -m benchmarks.training_curves                  # the docs' picture
    python -m benchmarks.training_curves --steps 20 --checkpoint-every 10 \\
        --stop-at 15 --output /tmp/curves.png             # a quick look
"""

import os
import shutil
import tempfile

from benchmarks import common

OUTPUT = os.path.join(common.ROOT, "docs", "images", "tensorboard_curves.png")
PANELS = (
    ("train/loss", "training loss (sum over heads)", False),
    ("train/learning_rate", "learning rate", False),
    ("train/tokens_per_second", "tokens/s", False),
    ("validation/perplexity_calibrated", "validation perplexity", True),
)


class _Stopped(Exception):
    pass


def run(workdir, steps, checkpoint_every, stop_at):
    """Trains, stops at `stop_at` and resumes; returns the curves'
    directory."""
    from keras_mhf.pretraining import hooks
    from keras_mhf.pretraining import pretrain

    settings = dict(
        architecture="mini_h4b1024",
        vocabulary_size=1000,
        sequence_length=128,
        batch_size=8,
        steps=steps,
        checkpoint_every=checkpoint_every,
        warmup_steps=max(steps // 10, 1),
        log_every=max(steps // 20, 1),
        validation_blocks=32,
        verbose=0,
    )
    output = os.path.join(workdir, "run")
    data = common.openstax_training_files()
    previous = hooks.event

    def stop(name, **info):
        if name == "train_step" and info["step"] == stop_at:
            raise _Stopped
        previous(name, **info)

    hooks.event = stop
    try:
        pretrain(data, output, **settings)
    except _Stopped:
        print(f"stopped at step {stop_at}")
    finally:
        hooks.event = previous
    _, summary = pretrain(data, output, **settings)
    assert summary["finished"], summary
    return os.path.join(output, "tensorboard")


def read_curves(directory):
    """`{tag: [(step, value), ...]}` as TensorBoard reads `directory`."""
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    reader = EventAccumulator(directory).Reload()
    return {
        tag: [(e.step, e.value) for e in reader.Scalars(tag)]
        for tag in reader.Tags()["scalars"]
    }


def draw(curves, png, stop_at, resumed_from):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(14, 3.2))
    for ax, (tag, title, log_scale) in zip(axes, PANELS):
        steps, values = zip(*curves[tag])
        ax.plot(steps, values, "o-", markersize=3)
        ax.axvline(stop_at, color="tab:red", linestyle=":", linewidth=1)
        ax.axvline(resumed_from, color="tab:gray", linestyle="--", linewidth=1)
        ax.set_title(f"{tag}\n{title}", fontsize=9)
        ax.set_xlabel("step")
        if log_scale:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"stopped at step {stop_at} (dotted), resumed from the checkpoint "
        f"at {resumed_from} (dashed): each step once",
        fontsize=10,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main(argv=None):
    parser = common.argument_parser("training_curves", __doc__)
    parser.add_argument("--output", default=OUTPUT, help="the PNG to write")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--stop-at", type=int, default=130)
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="training_curves_")
    try:
        directory = run(
            workdir, args.steps, args.checkpoint_every, args.stop_at
        )
        curves = read_curves(directory)
        for tag, points in curves.items():
            steps = [step for step, _ in points]
            assert steps == sorted(set(steps)), (tag, steps)
            print(tag, [(s, round(v, 4)) for s, v in points])
        resumed_from = (
            args.stop_at // args.checkpoint_every * args.checkpoint_every
        )
        draw(curves, args.output, args.stop_at, resumed_from)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
