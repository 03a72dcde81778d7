"""The fused cascade head's compiled training program at a device's shape,
compiled (not run) on this machine: how many sequential block steps it
takes, how large its matmuls are, and the temporaries XLA plans for it.

The head (`CascadeHashDecoder`, H = 4, B = 16,384, d = 768: the paper's
100M shape) computes the loss and every gradient from the final hidden
states of `--batch` sequences of `--sequence-length` positions
(`fused_signature_loss` under `jax.value_and_grad`, in bf16 compute over
float32 weights as the accelerator run-book trains). Each row is a block
size: the one chosen on a CPU (`device_memory=None`) and on devices of
`--device-memory` bytes (`automatic_block_size`). Reported from the compiled
program: the trip count of its block loop (sequential steps, each
recomputing its block under remat in the backward pass), its largest matmul
(`dot`) in multiply-adds and shapes, and XLA's temporaries.

    KERAS_BACKEND=jax python -m benchmarks.head_blocking
    KERAS_BACKEND=jax python -m benchmarks.head_blocking --batch 184 \
        --out benchmarks/results/head_blocking.md
"""

import os
import re

from benchmarks import common

os.environ.setdefault("KERAS_BACKEND", "jax")

# An 80 GB and a 141 GB device as JAX reports them (XLA's default pool is
# 75 % of the memory; an H200's bytes_limit in
# benchmarks/results/accelerator_h200) and as PyTorch does (the whole memory).
DEVICES = {
    "H100, JAX": 60_129_542_144,
    "H200, JAX": 112_583_507_968,
    "H200, PyTorch": 150_754_820_096,
}
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DEFINED = re.compile(r"(%[\w.\-]+) = \w+\[([\d,]*)\]")
_DOT = re.compile(r"= \w+\[([\d,]*)\]\S* dot\((%[\w.\-]+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text):
    return [int(v) for v in text.split(",") if v]


def dots(hlo):
    """`(multiply-adds, "[lhs] -> [out]")` of every `dot` of an HLO
    module's text (its operands' shapes from their definitions)."""
    shapes = {m.group(1): _dims(m.group(2)) for m in _DEFINED.finditer(hlo)}
    found = []
    for line in hlo.splitlines():
        match = _DOT.search(line)
        contracting = _CONTRACTING.search(line)
        lhs = shapes.get(match.group(2)) if match else None
        if lhs is None or contracting is None:
            continue
        out = _dims(match.group(1))
        macs = 1
        for v in out + [lhs[int(a)] for a in _dims(contracting.group(1))]:
            macs *= v
        found.append((macs, f"{lhs} -> {out}"))
    return found


def measure(block_size, args):
    import jax
    import keras
    import numpy as np

    from keras_mhf.layers import CascadeHashDecoder
    from keras_mhf.layers import HashEncoder
    from keras_mhf.losses.fused_signature_loss import fused_signature_loss

    keras.config.set_dtype_policy("mixed_bfloat16")
    encoder = HashEncoder(4, 16384, args.hidden_dim)
    decoder = CascadeHashDecoder(encoder)
    decoder.build((None, args.hidden_dim))
    positions = (args.batch, args.sequence_length)
    states = jax.ShapeDtypeStruct(positions + (args.hidden_dim,), "bfloat16")
    targets = jax.ShapeDtypeStruct(positions + (4,), "int32")
    values = [v.value for v in decoder.trainable_variables]

    def loss(values, states, targets):
        mapping = list(zip(decoder.trainable_variables, values))
        with keras.StatelessScope(state_mapping=mapping):
            return fused_signature_loss(
                decoder, states, targets, None, block_size
            )

    grad = jax.value_and_grad(loss, argnums=(0, 1))
    compiled = jax.jit(grad).lower(values, states, targets).compile()
    hlo = compiled.as_text()
    trips = [int(n) for n in _TRIP.findall(hlo)]
    biggest = max(dots(hlo), default=(0, "-"))
    memory = compiled.memory_analysis()
    return {
        "block": block_size,
        "blocks": -(-int(np.prod(positions)) // block_size),
        "loops": sorted(set(trips), reverse=True),
        "dot_macs": biggest[0],
        "dot": biggest[1],
        "temp_gib": memory.temp_size_in_bytes / 2**30,
    }


def main(argv=None):
    p = common.argument_parser("head_blocking", __doc__)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--sequence-length", type=int, default=1024)
    p.add_argument("--hidden-dim", type=int, default=768)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from keras_mhf.losses.fused_signature_loss import automatic_block_size

    rows = [("CPU", automatic_block_size(4, 16384))]
    rows += [
        (
            f"{name} ({memory / 1e9:.0f} GB)",
            automatic_block_size(4, 16384, memory),
        )
        for name, memory in DEVICES.items()
    ]
    lines = [
        "# The fused head's compiled program at the device shape",
        "",
        f"H4 B16384, d = {args.hidden_dim}, batch {args.batch} x sequence "
        f"{args.sequence_length} ({args.batch * args.sequence_length:,} "
        "positions), loss and gradients in mixed_bfloat16, compiled by XLA "
        "for this machine's CPU (not run). Written by "
        "`python -m benchmarks.head_blocking`.",
        "",
        "| blocking for | positions per block | block loop trips | largest "
        "matmul (multiply-adds: left operand -> output) | XLA temporaries GiB |",
        "|---|---|---|---|---|",
    ]
    seen = {}
    for name, block in rows:
        if block not in seen:
            seen[block] = measure(block, args)
        r = seen[block]
        lines.append(
            f"| {name} | {block} | {', '.join(map(str, r['loops'])) or 1} "
            f"| {r['dot_macs'] / 1e9:.1f} G: {r['dot']} "
            f"| {r['temp_gib']:.2f} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
