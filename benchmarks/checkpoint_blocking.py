"""How long a checkpoint stops training: Orbax's asynchronous write against
keras_mhf 0.1's synchronous h5 write, at the `mini` and 100M shapes.

For each shape a MultiHashFormer (synthetic vocabulary) with its AdamW state
built is checkpointed `--repeats` times each way, in this process:

- h5 (0.1): `save_weights` of the model and optimizer state into
  `model.weights.h5`, its sha256 and an fsync: all on the training thread.
- Orbax (now): `CheckpointWriter.save` until it returns: the small
  variables are copied into one pack per dtype and checked by one program,
  the check of the large ones is dispatched too; the large ones are Orbax's
  to copy off the devices, on the training thread; when there are none
  (every value written is a copy), Orbax's own setup runs on a writer
  thread.
  Then, apart, the time until the write is committed. Also apart: the
  synchronous finite check that a multi-process job runs before its save.

It prints (and with `--out` writes) the medians and the blocking ratio.

    KERAS_BACKEND=jax python -m benchmarks.checkpoint_blocking
    python -m benchmarks.checkpoint_blocking \
        --out benchmarks/results/checkpoint_blocking
"""

import os
import shutil
import sys
import tempfile
import time

import numpy as np

from benchmarks import common

SHAPES = {"mini": ("mini_h4b1024", 4096), "100m": ("100m_h4b16k", 32768)}


def build(architecture, vocabulary_size):
    from keras_mhf.optimizers import BiasCorrectedAdamW

    lm = common.synthetic_mhf(vocabulary_size, architecture)
    lm.compile(optimizer=BiasCorrectedAdamW(1e-4))
    lm.optimizer.build(lm.trainable_variables)
    return lm


def h5_write(lm, directory):
    """0.1's write: weights and optimizer state, sha256, fsync."""
    from keras_mhf.utils.files import file_sha256
    from keras_mhf.utils.files import fsync_file

    path = os.path.join(directory, "model.weights.h5")
    start = time.perf_counter()
    lm.save_weights(path)
    file_sha256(path)
    fsync_file(path)
    elapsed = time.perf_counter() - start
    size = os.path.getsize(path)
    os.remove(path)
    return elapsed, size


def orbax_write(lm, writer, step):
    """`(synchronous finite check s, save s until it returns, s until
    committed)`."""
    from keras_mhf.pretraining.checkpoints import _non_finite_variables

    start = time.perf_counter()
    assert not _non_finite_variables(lm)
    checked = time.perf_counter()
    writer.save(step, lm, {"step": step})
    returned = time.perf_counter()
    writer.wait()
    committed = time.perf_counter()
    return checked - start, returned - checked, committed - returned


def measure(shape, repeats):
    import keras

    from keras_mhf.pretraining.checkpoint_store import CheckpointWriter
    from keras_mhf.pretraining.checkpoints import variable_bytes

    architecture, vocabulary_size = SHAPES[shape]
    lm = build(architecture, vocabulary_size)
    directory = tempfile.mkdtemp(prefix="checkpoint_blocking_")
    try:
        writer = CheckpointWriter(os.path.join(directory, "orbax"), keep=1)
        orbax_write(lm, writer, 0)  # compiles the finite check
        h5 = [h5_write(lm, directory) for _ in range(repeats)]
        orbax = [orbax_write(lm, writer, k + 1) for k in range(repeats)]
        writer.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    finite, save, commit = (float(np.median(c)) for c in zip(*orbax))
    h5_seconds = float(np.median([t for t, _ in h5]))
    return dict(
        backend=keras.config.backend(),
        shape=shape,
        architecture=architecture,
        variables_mb=variable_bytes(lm) / 1e6,
        h5_mb=h5[0][1] / 1e6,
        h5_s=h5_seconds,
        finite_check_s=finite,
        orbax_save_s=save,
        orbax_commit_s=commit,
        blocking_ratio=save / h5_seconds,
    )


def format_table(rows, repeats):
    lines = [
        "# Checkpoint blocking time: Orbax (asynchronous) vs 0.1's h5",
        "",
        "Written by `python -m benchmarks.checkpoint_blocking` (CPU, 2 shared "
        f"cores; medians of {repeats} writes to local disk). Blocking: what "
        "the training thread waits for. h5 (0.1): `save_weights` of the "
        "weights and AdamW state, sha256, fsync. Orbax: `CheckpointWriter."
        "save` until it returns (the small variables are copied into one "
        "pack per dtype on the device, the large ones are copied off the "
        "devices by Orbax; the finite check of the values runs while they "
        "are written); the write then goes on in the background until the "
        "commit (not blocking). A multi-process job checks the values "
        "before saving (synchronous, last column).",
        "",
        "| backend | shape | variables MB | h5 blocking s | Orbax blocking "
        "s | ratio | Orbax commit s (background) | finite check s "
        "(multi-process) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['architecture']} | "
            f"{r['variables_mb']:,.1f} | {r['h5_s']:.3f} | "
            f"{r['orbax_save_s']:.3f} | {r['blocking_ratio']:.1%} | "
            f"{r['orbax_commit_s']:.3f} | {r['finite_check_s']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = common.argument_parser("checkpoint_blocking", __doc__)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    rows = []
    for shape in args.shapes:
        rows.append(measure(shape, args.repeats))
        print(rows[-1], flush=True)
    table = format_table(rows, args.repeats)
    print(table)
    if args.out:
        common.write_json(args.out + ".json", rows, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
