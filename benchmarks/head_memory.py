"""Peak training memory of the fused cascade head vs the unchunked one.

Each configuration runs in a fresh process: a random trunk (`--trunk`,
`mini` by default; `100m` is the paper's 12 x 768, 12/2 heads, MLP 2560)
with H = 4, B = 16,384 (`fused`, `unchunked`) or H = 3, B = 10,624
(`fused_h3`) on a synthetic vocabulary (`from_tokens`), sequence 1024, and
`train_on_batch` twice; reported are the peak RSS growth over the process
after the model is built (`ru_maxrss`), and the second step's time. The
Standard baseline (KerasHub Qwen3, the same trunk and V) gives the ratio; a
configuration killed for memory is reported as failed.

    python -m benchmarks.head_memory                  # jax, writes nothing
    python -m benchmarks.head_memory --out benchmarks/results/head_memory_jax.md
    python -m benchmarks.head_memory --trunk 100m --tokens 8192 --vocab 32768 \
        --modes fused fused_h3 standard \
        --out benchmarks/results/head_memory_100m.md
"""

import argparse
import os
import re
import sys
import time

import numpy as np

from benchmarks import common
from benchmarks import result_tables

MODES = ("fused", "unchunked", "standard")
# Mode -> the MHF hash configuration it builds on the trunk. `trunk` is the
# H4 B16384 backbone alone (hash encoder, blocks, norm) under a mean squared
# loss on its hidden states: what a step costs without any output head.
HASHES = {
    "fused": "h4b16k",
    "unchunked": "h4b16k",
    "fused_h3": "h3b10k",
    "trunk": "h4b16k",
}
# Headless rows: the base of the "head's share" (see `result_tables`).
TRUNKS = result_tables.TRUNKS


def build(
    mode, tokens_per_step, sequence_length, vocabulary_size, trunk, remat
):
    """The compiled model of a row and one batch `(x, y)`."""
    import keras

    from keras_mhf.utils.keras_utils import memory_lean

    if mode in ("standard", "standard_trunk"):
        model = common.synthetic_standard(
            vocabulary_size, trunk, rematerialize=remat
        )
    else:
        model = common.synthetic_mhf(
            vocabulary_size,
            f"{trunk}_{HASHES[mode]}",
            head_block_size=0 if mode == "unchunked" else None,
            rematerialize=remat,
        )
    batch = tokens_per_step // sequence_length
    x, y = common.random_batch(vocabulary_size, batch, sequence_length)
    if mode in TRUNKS:
        backbone = model.backbone
        model = keras.Model(backbone.input, backbone.output)
        # As the tasks' `compile` does (PyTorch: updates in groups).
        model.compile(
            optimizer=memory_lean(keras.optimizers.AdamW(1e-4)), loss="mse"
        )
        y = np.zeros((batch, sequence_length, backbone.hidden_dim), "float32")
    else:
        model.compile(optimizer=keras.optimizers.AdamW(1e-4))
    return model, x, y


def xla_sizes(model, x, y):
    """XLA's buffer sizes of the compiled JAX train step (no step runs):
    `(temporaries, arguments)` in MiB; the arguments are the weights, the
    optimizer's state and the batch (donated: the outputs reuse them)."""
    import jax

    model._symbolic_build(data_batch=(x, y, None))
    model.optimizer.build(model.trainable_variables)
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
        purge_model_variables=False,
    )
    compiled = jax.jit(model.train_step).lower(state, (x, y)).compile()
    analysis = compiled.memory_analysis()
    return (
        analysis.temp_size_in_bytes / 2**20,
        analysis.argument_size_in_bytes / 2**20,
    )


def worker(
    mode,
    tokens_per_step,
    sequence_length,
    vocabulary_size,
    trunk,
    remat,
    xla,
    precision="float32",
):
    import keras

    # As `--precision` of pre-training: bf16 weights (and AdamW state), or
    # bf16 compute over float32 weights.
    keras.config.set_dtype_policy(precision)
    model, x, y = build(
        mode, tokens_per_step, sequence_length, vocabulary_size, trunk, remat
    )
    if xla:
        temporaries, arguments = xla_sizes(model, x, y)
        result = dict(
            mode=mode,
            tokens=tokens_per_step,
            xla_temp_mib=temporaries,
            xla_argument_mib=arguments,
        )
        common.print_result(result)
        return
    base = common.peak_rss_bytes()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        loss = model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    peak = common.peak_rss_bytes()
    result = dict(
        mode=mode,
        tokens=tokens_per_step,
        peak_mib=(peak - base) / 2**20,
        first_step_s=times[0],
        step_s=times[1],
        loss=float(np.asarray(loss).reshape(-1)[0]),
    )
    common.print_result(result)


# XLA's CPU scheduler that runs independent ops concurrently ignores memory
# (see `qwen3_decoder_block.XLA_CPU_MEMORY_SCHEDULER`); it also keeps more
# buffers live: the 100M step without remat asks for 24.3 GB of temporaries
# under it, 12.2 GB without.


TORCH_MMAP_THRESHOLD = 65536


def worker_env():
    """The workers' environment: on JAX, XLA's CPU scheduler that minimises
    memory (`XLA_CPU_MEMORY_SCHEDULER`, added to any `XLA_FLAGS`); on
    PyTorch, a fixed malloc mmap threshold."""
    import keras

    from keras_mhf.models.qwen3_decoder_block import XLA_CPU_MEMORY_SCHEDULER

    env = dict(os.environ, KERAS_BACKEND=keras.config.backend())
    # PyTorch's CPU tensors come from glibc malloc, whose dynamic mmap
    # threshold keeps freed blocks of tens of MB resident: the fused head's
    # forward at 8,192 positions showed 3.7 GB of RSS for 0.3 GB live. A
    # fixed threshold returns them, so RSS follows what is live.
    if keras.config.backend() == "torch":  # as the table's header says
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(TORCH_MMAP_THRESHOLD))
    flags = env.get("XLA_FLAGS", "")
    if XLA_CPU_MEMORY_SCHEDULER.split("=")[0] not in flags:
        env["XLA_FLAGS"] = f"{flags} {XLA_CPU_MEMORY_SCHEDULER}".strip()
    return env


def main(argv=None):
    p = common.argument_parser("head_memory", __doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--sequence-length", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=[*HASHES, "standard", "standard_trunk"],
    )
    p.add_argument("--trunk", default="mini")
    p.add_argument(
        "--rematerialize",
        action="store_true",
        help="recompute the trunk's blocks in the backward pass (every model)",
    )
    p.add_argument(
        "--xla-analysis",
        action="store_true",
        help="JAX: report XLA's buffer sizes of the compiled step instead of "
        "running it (seconds per row; sizes that do not fit this machine too)",
    )
    p.add_argument(
        "--precision",
        default="float32",
        choices=("float32", "mixed_bfloat16", "bfloat16"),
        help="the models' dtype policy (as pre-training's --precision)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        mode, tokens = args.worker.split(":")
        return worker(
            mode,
            int(tokens),
            args.sequence_length,
            args.vocab,
            args.trunk,
            args.rematerialize,
            args.xla_analysis,
            args.precision,
        )
    rows = []
    for tokens in args.tokens:
        for mode in args.modes:
            command = [
                "--worker",
                f"{mode}:{tokens}",
                "--sequence-length",
                str(args.sequence_length),
                "--vocab",
                str(args.vocab),
                "--trunk",
                args.trunk,
                "--precision",
                args.precision,
                *(["--rematerialize"] if args.rematerialize else []),
                *(["--xla-analysis"] if args.xla_analysis else []),
            ]
            done = common.run_module(
                "head_memory",
                *command,
                capture_output=True,
                text=True,
                env=worker_env(),
            )
            found = common.results_in(done.stdout)
            if not found:
                print(done.stderr[-3000:], file=sys.stderr)
                why = failure(done.stderr, done.returncode)
                rows.append(dict(mode=mode, tokens=tokens, failed=why))
            else:
                rows.append(found[-1])
            print(rows[-1], flush=True)
            if args.out:  # after every row: a long run keeps what it has
                with open(args.out, "w") as f:
                    f.write(format_table(rows, args))
    print(format_table(rows, args))


def failure(stderr, returncode):
    """Why a worker gave no result, from its stderr and exit status."""
    xla = re.search(r"Out of memory allocating (\d+) bytes", stderr)
    if xla:  # XLA sized the step's buffers and could not allocate them
        return (
            "out of memory: the compiled step asks for "
            f"{int(xla.group(1)) / 2**20:,.0f} MiB"
        )
    tensor = re.search(
        r"OOM when allocating tensor with shape\[([\d,]+)\]", stderr
    )
    if tensor:  # TensorFlow
        shape = ", ".join(f"{int(n):,}" for n in tensor.group(1).split(","))
        return f"out of memory allocating a [{shape}] tensor"
    torch = re.search(r"you tried to allocate (\d+) bytes", stderr)
    if torch:
        return (
            f"out of memory allocating {int(torch.group(1)) / 2**20:,.0f} MiB"
        )
    if returncode in (-9, 137):
        return "killed (out of memory)"
    return f"exit status {returncode}"


def format_table(rows, args):
    import keras

    from keras_mhf.models.qwen3_decoder_block import XLA_CPU_MEMORY_SCHEDULER

    backend = keras.config.backend()
    trunk = f"{args.trunk} trunk" + (
        " (blocks rematerialised)" if args.rematerialize else ""
    )
    setting = (
        f"{trunk}, H4 B16384 (fused_h3: H3 B10624; trunk: the H4 backbone "
        "without a head; standard_trunk: Standard's), "
        f"V = {args.vocab:,} synthetic, sequence {args.sequence_length}, AdamW, "
        f"precision {args.precision}"
    )
    flag = {
        "jax": f"; XLA flag `{XLA_CPU_MEMORY_SCHEDULER}`",
        "torch": f"; `MALLOC_MMAP_THRESHOLD_={TORCH_MMAP_THRESHOLD}`; "
        "AdamW updates in groups of <= 64 MiB (`keras_utils.memory_lean`)",
    }.get(backend, "")
    lines = [f"# Training memory of the cascade head ({backend})", ""]
    if args.xla_analysis:
        lines += [
            f"`python -m benchmarks.head_memory --xla-analysis`: {setting}; "
            "XLA's "
            "buffer sizes of the compiled train step (temporaries: "
            "activations, logits, gradients; arguments: weights, optimizer "
            f"state, batch){flag}. Head's share: temporaries over the trunk "
            "row's (Standard: the standard_trunk row's) at the same tokens per "
            "step.",
            "",
        ]
    else:
        lines += [
            f"`python -m benchmarks.head_memory`: {setting}, two "
            "`train_on_batch` "
            "steps in a fresh process per row; peak RSS growth after the "
            "model is built, and the second step's time (CPU, 2 shared "
            f"cores: times are indicative){flag}. Head's share: peak over "
            "the trunk row's (Standard: the standard_trunk row's) at the same "
            "tokens per step.",
            "",
        ]
    lines += result_tables.head_memory_table(rows, args.xla_analysis)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
