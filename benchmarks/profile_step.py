"""Where a training step or a generated token spends its time (JAX backend).

    python -m benchmarks.profile_step  # H4B16384, V=32K, train + generate b1
    python -m benchmarks.profile_step --config standard --vocab 262144
    python -m benchmarks.profile_step --phase generate --batch-size 8

Tool: the JAX profiler (`jax.profiler.start_trace(..., create_perfetto_trace=
True)`), whose trace holds one event per executed XLA op (fusion, dot, copy,
...). Each event is mapped to the source of the op through the optimised HLO
that XLA dumps (`--xla_dump_to`; `metadata.op_name` names the Keras layer and
the primitive, e.g. `transpose(jvp(hash_decoder))/dot_general` is a matmul of
the decoder's backward pass). It prints the time per category (matmul,
copy/transpose, gather/scatter, other) and the top ops with their source.
The model and sizes are those of `benchmarks.benchmark` (same flags).
"""

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time

from benchmarks import common


def parse_args(argv=None):
    p = common.argument_parser("profile_step", __doc__)
    p.add_argument("--config", default="h4b16384", help="standard or h<H>b<B>")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument(
        "--phase",
        nargs="+",
        default=["train", "generate"],
        choices=["train", "generate"],
    )
    p.add_argument("--hidden-dim", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--sequence-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="training batch")
    p.add_argument("--generate-batch-size", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=15)
    p.add_argument(
        "--smoke", action="store_true", help="tiny sizes: checks the tool runs"
    )
    return p.parse_args(argv)


def op_sources(dump_dir, module):
    """Instruction name -> `metadata.op_name`, from the optimised HLO dump of
    the jitted function `module` (e.g. `train_step`)."""
    sources = {}
    pattern = re.compile(
        r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"'
    )
    for path in glob.glob(
        os.path.join(dump_dir, f"*jit_{module}.cpu_after_optimizations.txt")
    ):
        with open(path) as f:
            for line in f:
                match = pattern.match(line)
                if match:
                    sources.setdefault(match.group(1), match.group(2))
    return sources


def category(name, source):
    text = name + " " + source
    if "dot" in name or "ynn_fusion" in name or "dot_general" in source:
        return "matmul"
    if "scatter" in text or "gather" in text:
        return "gather/scatter"
    if name.startswith(
        ("copy", "transpose", "slice", "concatenate", "bitcast")
    ):
        return "copy/transpose/slice"
    return "other (elementwise, reductions, softmax, optimizer)"


def traced_ops(fn, repeats, trace_dir):
    import jax

    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(repeats):
        fn()
    jax.profiler.stop_trace()
    path = glob.glob(
        os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True
    )[-1]
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    totals = collections.Counter()
    for event in events:
        name = event.get("name", "")
        # Python frames ("$file:line") and executor bookkeeping are not ops.
        if event.get("ph") != "X" or name.startswith(
            ("$", "ThunkExecutor", "Pjit")
        ):
            continue
        if any(
            word in name
            for word in ("Compile", "compile", "Codegen", "Dispatch")
        ):
            continue
        totals[name] += event["dur"] / 1000.0 / repeats  # ms per repeat
    return totals


def report(title, totals, sources, wall_ms, top):
    lines = [
        f"## {title}: {wall_ms:.1f} ms wall, "
        f"{sum(totals.values()):.1f} ms in XLA ops"
    ]
    by_category = collections.Counter()
    for name, ms in totals.items():
        by_category[category(name, sources.get(name, ""))] += ms
    for name, ms in by_category.most_common():
        lines.append(
            f"  {ms:9.1f} ms  {100 * ms / max(wall_ms, 1e-9):5.1f}%  {name}"
        )
    lines.append("  top ops:")
    for name, ms in totals.most_common(top):
        source = sources.get(name, "?")
        source = source.replace("jit(train_step)/", "").replace(
            "jit(compiled_generate_function)/", ""
        )
        lines.append(f"  {ms:9.1f} ms  {name:<28} {source[:110]}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        args.config, args.vocab, args.hidden_dim, args.num_layers = (
            "h3b64",
            512,
            64,
            2,
        )
        args.sequence_length, args.batch_size, args.new_tokens = 16, 2, 4
    dump_dir = tempfile.mkdtemp(prefix="keras_mhf_hlo_")
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
    )
    import numpy as np

    model = common.benchmark_model(
        args.config,
        args.vocab,
        common.trunk_kwargs(args.hidden_dim, args.num_layers),
    )
    b, s = args.batch_size, args.sequence_length
    x, y = common.random_batch(args.vocab, b, s)
    sw = np.ones((b, s), "float32")
    print(
        f"# {args.config}, V={args.vocab}, "
        f"d={args.hidden_dim} x {args.num_layers} layers, "
        f"seq {s}, batch {b} (JAX profiler trace; HLO op_name as source)"
    )
    sections = []
    if "train" in args.phase:
        for _ in range(2):
            model.train_on_batch(x, y, sample_weight=sw)
        start = time.perf_counter()
        model.train_on_batch(x, y, sample_weight=sw)
        wall = 1000 * (time.perf_counter() - start)
        totals = traced_ops(
            lambda: model.train_on_batch(x, y, sample_weight=sw),
            2,
            os.path.join(dump_dir, "trace_train"),
        )
        sections.append(("training step", totals, wall, "train_step"))
    if "generate" in args.phase:
        g = args.generate_batch_size
        prompt = common.generation_prompt(
            g, 16, args.new_tokens, x["token_ids"][0, :16]
        )
        model.generate(prompt, stop_token_ids=None)
        start = time.perf_counter()
        model.generate(prompt, stop_token_ids=None)
        wall = 1000 * (time.perf_counter() - start) / args.new_tokens
        totals = traced_ops(
            lambda: model.generate(prompt, stop_token_ids=None),
            1,
            os.path.join(dump_dir, "trace_generate"),
        )
        totals = collections.Counter(
            {k: v / args.new_tokens for k, v in totals.items()}
        )
        sections.append(
            (
                f"generation, per new token, batch {g}",
                totals,
                wall,
                "compiled_generate_function",
            )
        )
    for title, totals, wall, module in sections:
        print(
            report(title, totals, op_sources(dump_dir, module), wall, args.top)
        )
    shutil.rmtree(dump_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
