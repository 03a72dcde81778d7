"""Peak training memory of the fused cascade head vs the unchunked one.

Each configuration runs in a fresh process: a random trunk (`--trunk`,
`mini` by default; `100m` is the paper's 12 x 768, 12/2 heads, MLP 2560)
with H = 4, B = 16,384 (`fused`, `unchunked`) or H = 3, B = 10,624
(`fused_h3`) on a synthetic vocabulary (`from_tokens`), sequence 1024, and
`train_on_batch` twice; reported are the peak RSS growth over the process
after the model is built (`ru_maxrss`), and the second step's time. The
Standard baseline (KerasHub Qwen3, the same trunk and V) gives the ratio; a
configuration killed for memory is reported as failed.

    python tools/head_memory.py                      # jax, writes nothing
    python tools/head_memory.py --out tools/results/head_memory_jax.md
    python tools/head_memory.py --trunk 100m --tokens 8192 --vocab 32768 \
        --modes fused fused_h3 standard --out tools/results/head_memory_100m.md
"""

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time

import numpy as np

MODES = ("fused", "unchunked", "standard")
# Mode -> the MHF hash configuration it builds on the trunk.
HASHES = {"fused": "h4b16k", "unchunked": "h4b16k", "fused_h3": "h3b10k"}


def worker(
    mode, tokens_per_step, sequence_length, vocabulary_size, trunk, remat
):
    import keras

    from keras_mhf import benchmarking
    from keras_mhf.models import MultiHashFormerCausalLM
    from keras_mhf.models import StandardCausalLM
    from keras_mhf.models import standard_backbone

    keras.utils.set_random_seed(0)
    if mode == "standard":
        model = StandardCausalLM(
            standard_backbone(vocabulary_size, trunk, rematerialize=remat),
            None,
        )
    else:
        model = MultiHashFormerCausalLM.from_tokens(
            benchmarking.synthetic_tokens(vocabulary_size),
            f"{trunk}_{HASHES[mode]}",
            pad_token_id=2,
            head_block_size=0 if mode == "unchunked" else None,
            rematerialize=remat,
        )
    model.compile(optimizer=keras.optimizers.AdamW(1e-4))
    batch = tokens_per_step // sequence_length
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocabulary_size, (batch, sequence_length + 1))
    x = {
        "token_ids": ids[:, :-1].astype("int32"),
        "padding_mask": np.ones((batch, sequence_length), "int32"),
    }
    y = ids[:, 1:].astype("int32")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(2):
        start = time.perf_counter()
        loss = model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = dict(
        mode=mode,
        tokens=tokens_per_step,
        peak_mib=(peak - base) / 1024,
        first_step_s=times[0],
        step_s=times[1],
        loss=float(np.asarray(loss).reshape(-1)[0]),
    )
    print("RESULT " + json.dumps(result), flush=True)


# XLA's CPU scheduler that runs independent ops concurrently ignores memory
# (see `qwen3_decoder_block.XLA_CPU_MEMORY_SCHEDULER`); it also keeps more
# buffers live: the 100M step without remat asks for 24.3 GB of temporaries
# under it, 12.2 GB without.


def worker_env():
    """The workers' environment: on JAX, XLA's CPU scheduler that minimises
    memory (`XLA_CPU_MEMORY_SCHEDULER`, added to any `XLA_FLAGS`)."""
    from keras_mhf.models.qwen3_decoder_block import XLA_CPU_MEMORY_SCHEDULER

    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if XLA_CPU_MEMORY_SCHEDULER.split("=")[0] not in flags:
        env["XLA_FLAGS"] = f"{flags} {XLA_CPU_MEMORY_SCHEDULER}".strip()
    return env


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--sequence-length", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=[*HASHES, "standard"]
    )
    p.add_argument("--trunk", default="mini")
    p.add_argument(
        "--rematerialize",
        action="store_true",
        help="recompute the trunk's blocks in the backward pass (every model)",
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
        )
    rows = []
    for tokens in args.tokens:
        for mode in args.modes:
            command = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                f"{mode}:{tokens}",
                "--sequence-length",
                str(args.sequence_length),
                "--vocab",
                str(args.vocab),
                "--trunk",
                args.trunk,
                *(["--rematerialize"] if args.rematerialize else []),
            ]
            done = subprocess.run(
                command, capture_output=True, text=True, env=worker_env()
            )
            lines = [
                line
                for line in done.stdout.splitlines()
                if line.startswith("RESULT ")
            ]
            if not lines:
                print(done.stderr[-3000:], file=sys.stderr)
                asked = re.search(
                    r"Out of memory allocating (\d+) bytes", done.stderr
                )
                if asked:  # XLA sized the step's buffers and could not
                    why = (
                        "out of memory: the compiled step asks for "
                        f"{int(asked.group(1)) / 2**20:,.0f} MiB"
                    )
                elif done.returncode in (-9, 137):
                    why = "killed (out of memory)"
                else:
                    why = f"exit status {done.returncode}"
                rows.append(dict(mode=mode, tokens=tokens, failed=why))
            else:
                rows.append(json.loads(lines[-1][len("RESULT ") :]))
            print(rows[-1], flush=True)
            if args.out:  # after every row: a long run keeps what it has
                with open(args.out, "w") as f:
                    f.write(format_table(rows, args))
    print(format_table(rows, args))


def format_table(rows, args):
    import keras

    from keras_mhf.models.qwen3_decoder_block import XLA_CPU_MEMORY_SCHEDULER

    standard = {r["tokens"]: r for r in rows if r["mode"] == "standard"}
    lines = [
        f"# Training memory of the cascade head ({keras.config.backend()})",
        "",
        f"`python tools/head_memory.py`: {args.trunk} trunk"
        f"{' (blocks rematerialised)' if args.rematerialize else ''}, H4 B16384 "
        "(fused_h3: H3 B10624), "
        f"V = {args.vocab:,} synthetic, sequence {args.sequence_length}, "
        "AdamW, two `train_on_batch` steps in a fresh process per row; peak "
        "RSS growth after the model is built, and the second step's time "
        "(CPU, 2 shared cores: times are indicative)"
        + (
            f"; XLA flag `{XLA_CPU_MEMORY_SCHEDULER}`."
            if keras.config.backend() == "jax"
            else "."
        ),
        "",
        "| head | tokens/step | peak MiB | / Standard | step s | loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("failed"):
            lines.append(
                f"| {r['mode']} | {r['tokens']} | {r['failed']} | | | |"
            )
            continue
        std = standard.get(r["tokens"])
        ratio = (
            f"{r['peak_mib'] / std['peak_mib']:.2f}"
            if std and not std.get("failed") and std["peak_mib"] > 0
            else ""
        )
        lines.append(
            f"| {r['mode']} | {r['tokens']} | {r['peak_mib']:.0f} | {ratio} "
            f"| {r['step_s']:.2f} | {r['loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
