"""The accelerator run-book's measurements: MHF against the Standard
baseline at the paper's 100M shape on whatever accelerator this machine has
(`benchmarks/accelerator_check.sh` installs what is missing and runs this).

For each vocabulary size (`--vocab`, default 32K and 256K) and model (MHF
H4 B16384 with the fused cascade head, and Standard: KerasHub Qwen3 on the
same trunk), a training step at sequence 1024 is measured at a probe batch,
and at twice that batch (in one process), then at the largest batch the two
peaks of device memory say fits (their difference is the memory per sequence, the rest a
fixed part such as the fused head's block; 90 % of the device's memory, a
multiple of 8, at most `--max-batch`); decoding (greedy,
KV cache, batch 1, 32 new tokens after 16) at `--decode-vocab` (default 32K
and 1M). Reported: tokens/s, model-FLOPs utilisation (analytic training
FLOPs x tokens/s over the device's peak for the precision: the vendor's
dense number where known, and a bf16/f32 matmul measured in the same run),
peak device memory, and MHF/Standard ratios. Each measurement runs in its
own process, so peak memory is per model.

    bash benchmarks/accelerator_check.sh                  # on a GPU/TPU machine
    python -m benchmarks.accelerator_check --smoke --output /tmp/check   # CPU
"""

import argparse
import json
import os
import time

import numpy as np

from benchmarks import common

# Dense peak FLOP/s by device name (vendor numbers, without sparsity).
PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},
    "TPU v4": {"bfloat16": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12},
    "TPU v5p": {"bfloat16": 459e12},
}
# Model -> the MHF hash configuration of its architecture name.
MODELS = {"standard": None, "h4b16384": "h4b16k"}
SMOKE_MODELS = {"standard": None, "h4b64": "h4b64"}


def parse_args(argv=None):
    p = common.argument_parser(
        "accelerator_check",
        __doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--output", default=common.RESULTS)
    p.add_argument("--trunk", default="100m")
    p.add_argument("--vocab", nargs="+", type=int, default=[32768, 262144])
    p.add_argument(
        "--decode-vocab", nargs="+", type=int, default=[32768, 1048576]
    )
    p.add_argument("--sequence-length", type=int, default=1024)
    p.add_argument("--probe-batch", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument(
        "--precision",
        default="mixed_bfloat16",
        help="Keras dtype policy of the models (the authors trained in bf16)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on any machine (the suite runs this on CPU)",
    )
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = MODELS
    if args.smoke:
        args.trunk, args.vocab, args.decode_vocab = "tiny", [512], [2048]
        args.sequence_length, args.probe_batch = 32, 2
        args.max_batch, args.steps = 4, 2
        args.models = SMOKE_MODELS
    return args


def build(model, vocabulary_size, args):
    import keras

    keras.config.set_dtype_policy(args.precision)
    if model == "standard":
        lm = common.synthetic_standard(vocabulary_size, args.trunk)
    else:
        lm = common.synthetic_mhf(
            vocabulary_size, f"{args.trunk}_{args.models[model]}"
        )
    lm.compile(optimizer=keras.optimizers.AdamW(1e-4), sampler="greedy")
    return lm


def train_worker(model, vocabulary_size, batches, args):
    """A training step at each of `batches` (in this order, one model):
    the result of the last, and `probes`, every batch's."""
    lm = build(model, vocabulary_size, args)
    n = args.sequence_length
    blocks = {}
    if model != "standard":  # the fused head's blocking on this device
        from keras_mhf.losses.fused_signature_loss import automatic_block_size
        from keras_mhf.utils.device_memory import accelerator_memory_bytes

        decoder = lm.hash_decoder
        blocks["head_block_size"] = automatic_block_size(
            decoder.num_hashes, decoder.num_buckets, accelerator_memory_bytes()
        )
    results = []
    for batch in batches:
        x, y = common.random_batch(vocabulary_size, batch, n)
        for _ in range(2):  # compile, warm up
            loss = lm.train_on_batch(x, y)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            loss = lm.train_on_batch(x, y)
            times.append(time.perf_counter() - start)
        step = float(np.median(times))
        if blocks:  # as fused_signature_loss cuts a step's positions
            size = min(blocks["head_block_size"], batch * n)
            blocks["head_block_positions"] = size
            blocks["head_blocks"] = -(-batch * n // size)
        results.append(
            blocks
            | {
                "batch": batch,
                "step_s": step,
                "tokens_per_s": batch * n / step,
                # The process's peak: a larger batch's, measured after a
                # smaller one's.
                "peak_memory_bytes": common.peak_memory_bytes(),
                "loss": float(np.asarray(loss).reshape(-1)[0]),
            }
        )
    return results[-1] | {"probes": results}


def decode_worker(model, vocabulary_size, args):
    lm = build(model, vocabulary_size, args)
    return {
        "decode_ms_per_token_b1": common.generation_ms_per_token(lm, 1),
        "peak_memory_bytes": common.peak_memory_bytes(),
    }


def matmul_worker(args):
    """Measured peak FLOP/s of a compiled square matmul in the policy's
    compute dtype."""
    import keras
    from keras import ops

    dtype = keras.DTypePolicy(args.precision).compute_dtype
    size = 512 if args.smoke else 8192
    a = keras.random.normal((size, size), dtype=dtype, seed=0)

    def run():
        return ops.convert_to_numpy(ops.sum(ops.matmul(a, a)))

    if keras.config.backend() == "jax":
        import jax

        f = jax.jit(lambda x: x @ x)
        f(a).block_until_ready()
        start = time.perf_counter()
        for _ in range(20):
            out = f(a)
        out.block_until_ready()
    else:
        run()
        start = time.perf_counter()
        for _ in range(5):
            run()
    from keras_mhf.utils.device_memory import device_info

    repeats = 20 if keras.config.backend() == "jax" else 5
    name, platform, memory = device_info()
    return {
        "device": name,
        "platform": platform,
        "device_memory_bytes": memory,
        "compute_dtype": dtype,
        "measured_peak_flops": 2
        * size**3
        * repeats
        / (time.perf_counter() - start),
    }


def call_worker(args, *worker):
    """Runs one measurement in a fresh process: its result, or `None` and
    the error's last line (a batch that does not fit, say). `--smoke`
    measures in this process (seconds; peak memory is then cumulative)."""
    if args.smoke:
        return measure(args, *worker), None
    command = ["--worker", *worker]
    command += ["--trunk", args.trunk, "--precision", args.precision]
    command += ["--sequence-length", str(args.sequence_length)]
    command += ["--steps", str(args.steps)] + (
        ["--smoke"] if args.smoke else []
    )
    started = time.time()
    done = common.run_module(
        "accelerator_check", *command, capture_output=True, text=True
    )
    print(
        f"[{time.strftime('%H:%M:%S')}] {' '.join(map(str, worker))}: "
        f"{time.time() - started:.0f} s",
        flush=True,
    )
    found = common.results_in(done.stdout)
    if done.returncode == 0 and found:
        return found[-1], None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return None, (lines[-1] if lines else f"exit {done.returncode}")[:300]


def fitting_batch(probes, memory_limit, args):
    """The largest batch (a multiple of 8, at most `--max-batch`) whose
    memory, on the line through the probes' peaks (one probe: through 0),
    is within 90 % of the device."""
    if not memory_limit:
        return args.max_batch
    probe = probes[0]
    per_sequence = probe["peak_memory_bytes"] / probe["batch"]
    fixed = 0
    if len(probes) > 1:
        other = probes[1]
        grown = other["peak_memory_bytes"] - probe["peak_memory_bytes"]
        if grown > 0:
            per_sequence = grown / (other["batch"] - probe["batch"])
            fixed = max(
                0, probe["peak_memory_bytes"] - per_sequence * probe["batch"]
            )
    batch = int((0.9 * memory_limit - fixed) / per_sequence)
    batch = batch // 8 * 8 if batch >= 8 else batch
    return max(probes[-1]["batch"], min(batch, args.max_batch))


def run(args):
    device, _ = call_worker(args, "matmul")
    name = device["device"]
    compute = device["compute_dtype"]
    nominal = next(
        (v.get(compute) for k, v in PEAK_FLOPS.items() if k in name), None
    )
    trunk = common.paper_trunk(args.trunk)
    report = {"device": device, "args": vars(args), "train": [], "decode": []}
    for vocabulary_size in args.vocab:
        for model in args.models:
            probe, error = call_worker(
                args,
                "train",
                model,
                vocabulary_size,
                f"{args.probe_batch},{2 * args.probe_batch}",
            )
            row = {"model": model, "vocabulary_size": vocabulary_size}
            if probe is None:
                report["train"].append(row | {"error": error})
                continue
            probes = probe.pop("probes")
            best = max(probes, key=lambda p: p["tokens_per_s"])
            batch = fitting_batch(probes, device["device_memory_bytes"], args)
            if batch > probes[-1]["batch"]:
                larger, error = call_worker(
                    args, "train", model, vocabulary_size, batch
                )
                if larger is not None:
                    larger.pop("probes")
                    best = larger
                else:
                    row["larger_batch_error"] = f"batch {batch}: {error}"
            flops = common.flops_per_token(
                model, vocabulary_size, trunk, args.sequence_length
            )
            row |= best | {"probes": probes, "flops_per_token": flops}
            row["memory_per_sequence_bytes"] = (
                best["peak_memory_bytes"] / best["batch"]
            )
            row["mfu_measured_peak"] = (
                flops * best["tokens_per_s"] / device["measured_peak_flops"]
            )
            if nominal:
                row["mfu"] = flops * best["tokens_per_s"] / nominal
            report["train"].append(row)
            print(json.dumps(row), flush=True)
            _write(report, args)
    for vocabulary_size in args.decode_vocab:
        for model in args.models:
            result, error = call_worker(args, "decode", model, vocabulary_size)
            row = {"model": model, "vocabulary_size": vocabulary_size}
            row |= result if result is not None else {"error": error}
            report["decode"].append(row)
            print(json.dumps(row), flush=True)
            _write(report, args)
    report["nominal_peak_flops"] = nominal
    _write(report, args)
    return report


def _ratio(rows, key, vocabulary_size):
    by_model = {
        r["model"]: r.get(key)
        for r in rows
        if r["vocabulary_size"] == vocabulary_size
    }
    standard = by_model.pop("standard", None)
    mhf = next(iter(by_model.values()), None)
    return mhf / standard if mhf and standard else None


def markdown(report):
    device = report["device"]
    lines = [
        f"# Accelerator check: {device['device']} ({device['platform']})",
        "",
        f"Precision `{report['args']['precision']}` (compute "
        f"{device['compute_dtype']}); trunk `{report['args']['trunk']}`, "
        f"sequence {report['args']['sequence_length']}. Measured matmul peak "
        f"{device['measured_peak_flops'] / 1e12:.1f} TFLOP/s"
        + (
            f", vendor dense peak {report['nominal_peak_flops'] / 1e12:.0f} "
            "TFLOP/s"
            if report.get("nominal_peak_flops")
            else ""
        )
        + ". Written by `python -m benchmarks.accelerator_check`.",
        "",
        "| V | model | batch | tokens/s | MFU (vendor) | MFU (measured) "
        "| peak memory GiB | MHF/Std tokens/s | MHF/Std memory per sequence "
        "| head blocks x positions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["train"]:
        v = r["vocabulary_size"]
        if "error" in r:
            lines.append(f"| {v} | {r['model']} | failed: {r['error']} |")
            continue
        speed = _ratio(report["train"], "tokens_per_s", v)
        memory = _ratio(report["train"], "memory_per_sequence_bytes", v)
        mfu = f"{r['mfu']:.3f}" if "mfu" in r else "-"
        lines.append(
            f"| {v} | {r['model']} | {r['batch']} | {r['tokens_per_s']:,.0f} "
            f"| {mfu} | {r['mfu_measured_peak']:.3f} "
            f"| {r['peak_memory_bytes'] / 2**30:.2f} "
            f"| {_fmt(speed) if r['model'] != 'standard' else ''} "
            f"| {_fmt(memory) if r['model'] != 'standard' else ''} "
            + (
                f"| {r['head_blocks']} x {r['head_block_positions']} |"
                if "head_blocks" in r
                else "| |"
            )
        )
    lines += [
        "",
        "| V | model | decode ms/token (batch 1) | MHF/Std |",
        "|---|---|---|---|",
    ]
    for r in report["decode"]:
        v = r["vocabulary_size"]
        if "error" in r:
            lines.append(f"| {v} | {r['model']} | failed: {r['error']} | |")
            continue
        ratio = _ratio(report["decode"], "decode_ms_per_token_b1", v)
        lines.append(
            f"| {v} | {r['model']} | {r['decode_ms_per_token_b1']:.2f} "
            f"| {_fmt(ratio) if r['model'] != 'standard' else ''} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(ratio):
    return "-" if ratio is None else f"{ratio:.2f}x"


def _write(report, args):
    stem = os.path.join(args.output, "accelerator_check")
    common.write_json(stem + ".json", report, indent=1)
    if report["train"] or report["decode"]:
        with open(stem + ".md", "w") as f:
            f.write(markdown(report))


def measure(args, kind, *rest):
    """One measurement: `("matmul",)`, `("train", model, V, batches)`
    (comma-separated) or `("decode", model, V)`."""
    if kind == "matmul":
        return matmul_worker(args)
    if kind == "train":
        batches = [int(b) for b in str(rest[2]).split(",")]
        return train_worker(rest[0], int(rest[1]), batches, args)
    return decode_worker(rest[0], int(rest[1]), args)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        result = measure(args, *args.worker)
        common.print_result(result)
        return result
    report = run(args)
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
