"""Peak training memory of gradient accumulation: it follows the
micro-batch, not the batch.

Each configuration `(batch, N)` trains in a fresh process the way a
pre-training run does (`RunConfig`, `load_data`, `build_run_model`,
`train_chunk`, so `fit` sees micro-batches of `batch / N` windows from the
run's loader) on a corpus prepared here from the tiny SentencePiece model of
`benchmarks/common.py` (no data files). The model is `--architecture`
(`mini_h4b1024`: activations far above the weights), sequence 512, blocks not
rematerialised, float32. A first chunk of one optimizer step compiles the
step and builds the optimizer's state (AdamW moments and, with N > 1, the
accumulators); then the peak-RSS mark is reset (`/proc/self/clear_refs`) and
`--steps` more optimizer steps run. Reported per row, in MB:

- `step_peak_mb`: the peak RSS of those later steps over the RSS after the
  model was built (before any step): the training step's memory, with the
  optimizer's state and the compiled program, without compiling;
- `first_chunk_peak_mb`: the same for the first chunk (compiling included);
- `total_peak_mb`: the process's peak RSS (imports, model, everything);
- the trainable weights, AdamW's state and the accumulators (analytic:
  their variables' bytes); on JAX also XLA's temporaries of the compiled
  step (`xla_temp_mb`: activations and gradients of one micro-batch).

The ratios are each row's `step_peak_mb` over the (batch 8, N 1) row's,
measured in the same run. Workers run in `benchmarks.head_memory`'s
environment (JAX: XLA's memory-minimising CPU scheduler; PyTorch: a fixed
malloc mmap threshold, so RSS follows what is live).

    python -m benchmarks.accumulation_memory   # KERAS_BACKEND's; writes
        # benchmarks/results/accumulation_memory_<backend>.json and .md
    KERAS_BACKEND=torch python -m benchmarks.accumulation_memory
    python -m benchmarks.accumulation_memory --smoke --output /tmp/a.json
"""

import argparse
import json
import os
import sys
import tempfile

from benchmarks import common
from benchmarks import result_tables

CONFIGS = ("8:1", "64:8", "64:1")
# The target of issue #56: batch 64 in 8 micro-batches within 1.15x of the
# memory of batch 8.
TARGET = 1.15


# --- memory -----------------------------------------------------------------


def reset_peak_rss():
    """Resets this process's peak RSS (`ru_maxrss`, VmHWM) to its current
    RSS (Linux >= 4.0: `clear_refs` 5); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def variable_megabytes(variables):
    """The bytes of `variables` (their shapes and dtypes), in MB."""
    import numpy as np

    total = 0
    for v in variables:
        total += int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
    return total / 2**20


# --- data -------------------------------------------------------------------


def prepare_corpus(root, documents=3000, seed=0):
    """A prepared corpus under `root` (`(directory, tokenizer path)`):
    `documents` JSONL documents of 1-3 of `common.SENTENCES`, tokenized by
    `common.small_sentencepiece()`."""
    import numpy as np

    from keras_mhf.data import prepare_data

    os.makedirs(root, exist_ok=True)
    tokenizer = os.path.join(root, "small.model")
    with open(tokenizer, "wb") as f:
        f.write(common.small_sentencepiece())
    rng = np.random.default_rng(seed)
    texts = os.path.join(root, "docs.jsonl")
    with open(texts, "w", encoding="utf-8") as f:
        for _ in range(documents):
            chosen = rng.choice(common.SENTENCES, size=rng.integers(1, 4))
            f.write(json.dumps({"text": " ".join(chosen)}) + "\n")
    prepared = os.path.join(root, "prepared")
    prepare_data(
        texts,
        tokenizer,
        prepared,
        validation_fraction=0.2,
        workers=1,
        progress=False,
    )
    return prepared, tokenizer


# --- one configuration --------------------------------------------------------


def measure(prepared, output, batch, parts, args, xla=None):
    """Trains one `(batch, N = parts)` configuration as a run does and
    returns its row (see the module docstring). `xla`: also XLA's buffer
    sizes of the compiled step (default: on JAX)."""
    import keras

    from keras_mhf.pretraining import RunConfig
    from keras_mhf.pretraining.config import run_scope
    from keras_mhf.pretraining.data import load_data
    from keras_mhf.pretraining.training import build_run_model
    from keras_mhf.pretraining.training import train_chunk

    steps = 1 + args.steps
    config = RunConfig(
        prepared,
        output,
        architecture=args.architecture,
        sequence_length=args.sequence_length,
        batch_size=batch,
        gradient_accumulation_steps=parts,
        steps=steps,
        checkpoint_every=steps,
        warmup_steps=1,
        validation_blocks=1,
        rematerialize=False,
        compilation_cache="none",
        tensorboard="none",
        verbose=0,
    )
    config.validate()
    with run_scope(config):
        data = load_data(config)
        lm = build_run_model(config, data.tokenizer)
        built = common.current_rss_bytes()
        history = train_chunk(config, lm, data, 0, 1)
        first = common.peak_rss_bytes()
        settled = common.current_rss_bytes()
        reset = reset_peak_rss()
        history = train_chunk(config, lm, data, 1, steps)
        peak = common.peak_rss_bytes()
    optimizer = lm.optimizer
    accumulators = getattr(optimizer, "_accumulated_gradients", None) or []
    megabyte = 2**20
    row = dict(
        batch=batch,
        micro_batches=parts,
        micro_batch=batch // parts,
        step_peak_mb=(peak - built) / megabyte,
        first_chunk_peak_mb=(first - built) / megabyte,
        total_peak_mb=max(first, peak) / megabyte,
        model_rss_mb=built / megabyte,
        after_first_chunk_mb=(settled - built) / megabyte,
        step_transient_mb=(peak - settled) / megabyte,
        weights_mb=variable_megabytes(lm.trainable_variables),
        accumulators_mb=variable_megabytes(accumulators),
        optimizer_state_mb=variable_megabytes(optimizer.variables)
        - variable_megabytes(accumulators),
        loss=float(history.history["loss"][-1]),
        peak_reset=reset,
    )
    if xla is None:
        xla = keras.config.backend() == "jax"
    if xla:
        from benchmarks import head_memory

        micro = batch // parts
        x, y = common.random_batch(
            data.tokenizer.vocabulary_size(), micro, args.sequence_length
        )
        temporaries, arguments = head_memory.xla_sizes(lm, x, y)
        row.update(xla_temp_mb=temporaries, xla_argument_mb=arguments)
    return row


def worker(spec, prepared, output, args):
    batch, parts = (int(n) for n in spec.split(":"))
    common.print_result(measure(prepared, output, batch, parts, args))


# --- the run ----------------------------------------------------------------


def ratios(rows):
    """Each row's `step_peak_mb` over that of the batch-8, N-1 row (the
    first row without accumulation, if none is batch 8), as `ratio`."""
    plain = [r for r in rows if "failed" not in r and r["micro_batches"] == 1]
    base = next(
        (r for r in plain if r["batch"] == 8), plain[0] if plain else None
    )
    for r in rows:
        if base is not None and "failed" not in r:
            r["ratio"] = r["step_peak_mb"] / base["step_peak_mb"]
    return rows


def run(args, workdir):
    from benchmarks import head_memory

    prepared, _ = prepare_corpus(os.path.join(workdir, "corpus"))
    rows = []
    for spec in args.configs:
        batch, parts = (int(n) for n in spec.split(":"))
        output = os.path.join(workdir, f"run_{batch}_{parts}")
        if args.smoke:  # in this process: its numbers mean nothing
            rows.append(measure(prepared, output, batch, parts, args))
        else:
            done = common.run_module(
                "accumulation_memory",
                "--worker",
                spec,
                "--prepared",
                prepared,
                "--run-output",
                output,
                *_options(args),
                capture_output=True,
                text=True,
                env=head_memory.worker_env(),
            )
            found = common.results_in(done.stdout)
            if found:
                rows.append(found[-1])
            else:
                print(done.stderr[-3000:], file=sys.stderr)
                why = head_memory.failure(done.stderr, done.returncode)
                rows.append(dict(batch=batch, micro_batches=parts, failed=why))
        print(rows[-1], flush=True)
    return ratios(rows)


def _options(args):
    return [
        "--architecture",
        args.architecture,
        "--sequence-length",
        args.sequence_length,
        "--steps",
        args.steps,
    ]


def report(rows, settings, backend):
    """The Markdown report of a run."""
    lines = [
        f"# Peak training memory of gradient accumulation ({backend})",
        "",
        result_tables.accumulation_memory_caption(settings, backend),
        "",
        *result_tables.accumulation_memory_table(rows),
        "",
        result_tables.accumulation_memory_summary(rows),
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = common.argument_parser(
        "accumulation_memory",
        __doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        help="BATCH:N pairs (global batch, micro-batches per optimizer step)",
    )
    p.add_argument("--architecture", default="mini_h4b1024")
    p.add_argument("--sequence-length", type=int, default=512)
    p.add_argument(
        "--steps",
        type=int,
        default=1,
        help="optimizer steps measured after the first (compiling) one",
    )
    p.add_argument(
        "--output",
        default=None,
        help="JSON result (a .md beside it); default "
        "benchmarks/results/accumulation_memory_<backend>.json",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, measured in this process: checks the tool runs",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prepared", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-output", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.prepared, args.run_output, args)
    import keras

    backend = keras.config.backend()
    if args.smoke:
        args.architecture, args.sequence_length, args.steps = (
            "tiny_h3b64",
            32,
            1,
        )
        if args.configs == list(CONFIGS):
            args.configs = ["4:1", "8:2"]
    with tempfile.TemporaryDirectory() as workdir:
        rows = run(args, workdir)
    settings = {
        k: v
        for k, v in vars(args).items()
        if k not in ("worker", "prepared", "run_output", "output")
    }
    output = args.output or os.path.join(
        common.RESULTS, f"accumulation_memory_{backend}.json"
    )
    common.write_json(
        output, {"backend": backend, "settings": settings, "results": rows}
    )
    text = report(rows, settings, backend)
    with open(os.path.splitext(output)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
