"""Measures the streaming data path of pre-training: memory, throughput and
resume time, on corpora synthesised at run time (not a test).

    python -m benchmarks.benchmark_data                   # about 12 minutes
    python -m benchmarks.benchmark_data --small-mb 20 --large-mb 200  # quicker
    python -m benchmarks.benchmark_data --sections tests  # test timings only

Sections (`--sections`, default all but `tests`):

- `prepare`: two corpora of OpenStax text (its documents repeated, each copy
  in a new order) of about --small-mb and --large-mb megabytes are written to
  a temporary directory and prepared with `keras_mhf.data.prepare_data` and
  the Mistral tokenizer; tokens/s with every core and, on the small one, with
  one worker.
- `reader`: how fast `prepare_data`'s main process alone reads and parses
  JSONL documents (`DocumentReader`): the ceiling that adding tokenizer
  workers cannot pass.
- `formats`: the same OpenStax documents read by `DocumentReader` as
  published corpora come: the JSONL files, `.jsonl.zst`, Parquet with
  FineWeb-Edu's columns (one file per JSONL file, row groups of
  --row-group-rows rows) and a `datasets` save_to_disk folder; MB/s of
  document text and documents/s, the best of --format-passes interleaved
  passes each, and Parquet's rate over JSONL's (target: at least 1x).
- `rss`: peak resident memory (`ru_maxrss` of the child) of `keras-mhf
  pretrain` training the tiny architecture for --steps steps on each
  prepared corpus; the two peaks must differ by less than 150 MB.
- `loader`: windows/s of `window_dataset` iterated as `train_chunk` hands it
  to `fit` (sequence length 128, batch 8), against the training tokens/s of
  `mini_h4b1024` at the same shape; the loader must deliver at least 20x.
- `resume`: a `keras-mhf pretrain` run on the large corpus is killed
  (SIGKILL) after its first checkpoint and started again; the time from the
  new process's start to the end of its first training step.
- `tests`: wall time of `pytest tests/pretraining` per backend.

Results go to --output (JSON) and the same name with `.md` (a short table);
a run of some sections keeps the other sections' earlier results. Every
temporary file is removed at the end.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks import common
from benchmarks import result_tables

MISTRAL = common.MISTRAL
# The pre-training runs' tests (a package of modules).
PRETRAINING_TESTS = os.path.join("tests", "pretraining")
SECTIONS = ("prepare", "reader", "formats", "rss", "loader", "resume", "tests")
RSS_LIMIT_MB = 150
LOADER_FACTOR = 20
RESUME_TARGET_S = 10
PARQUET_FACTOR = 1.0

# Runs a command as its child and reports the child's peak resident memory.
PEAK_RSS = """
import json, resource, subprocess, sys, time
started = time.time()
done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL,
                      stderr=subprocess.PIPE, text=True)
peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"returncode": done.returncode, "peak_kb": peak_kb,
                  "seconds": time.time() - started,
                  "stderr": done.stderr[-2000:]}))
"""

# `keras-mhf ARGS`, printing the time at the end of its first training step.
TIMED_RECIPE = """
import sys, time
from keras_mhf.pretraining import hooks
from keras_mhf.cli.main import main

first = []

def event(name, **info):
    if name == "train_step" and not first:
        first.append(time.time())
        print(f"FIRST_STEP_DONE {first[0]:.3f}", flush=True)

hooks.event = event
sys.exit(main(sys.argv[1:]))
"""


def parse_args(argv=None):
    p = common.argument_parser(
        "benchmark_data",
        __doc__,
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--small-mb", type=float, default=100)
    p.add_argument("--large-mb", type=float, default=2000)
    p.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=SECTIONS[:-1]
    )
    p.add_argument("--backend", default="jax", help="KERAS_BACKEND to use")
    p.add_argument(
        "--steps", type=int, default=20, help="steps of the memory runs"
    )
    p.add_argument(
        "--test-backends", nargs="+", default=["jax", "tensorflow", "torch"]
    )
    p.add_argument(
        "--format-passes",
        type=int,
        default=7,
        help="passes over the text per format (formats section)",
    )
    p.add_argument(
        "--row-group-rows",
        type=int,
        default=100,
        help="rows per Parquet row group (formats section)",
    )
    p.add_argument(
        "--output",
        default=os.path.join(common.RESULTS, "benchmark_data.json"),
    )
    p.add_argument(
        "--note",
        default=None,
        help="free text stored with the results (e.g. what else ran on the "
        "machine at the time)",
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="where the temporary corpora go (default: the system's "
        "temporary directory); removed at the end",
    )
    return p.parse_args(argv)


def openstax_documents():
    from keras_mhf.data import read_documents

    return list(read_documents(common.openstax_training_files()))


def synthesise(path, megabytes, documents, seed):
    """Writes OpenStax documents, repeated in a new order each time, until
    the file holds `megabytes`; returns its size in bytes."""
    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    lines = [json.dumps({"text": d}) + "\n" for d in documents]
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            rng.shuffle(lines)
            for line in lines:
                f.write(line)
                written += len(line.encode("utf-8"))
                if written >= target:
                    break
    return os.path.getsize(path)


def prepare(text, output, workers):
    from keras_mhf.data import available_cores
    from keras_mhf.data import prepare_data

    started = time.time()
    index = prepare_data(
        text,
        MISTRAL,
        output,
        validation_fraction=0.01,
        workers=workers,
        progress=False,
    )
    seconds = time.time() - started
    workers = workers or available_cores()
    tokens = sum(index["splits"][s]["tokens"] for s in ("train", "validation"))
    shard_bytes = sum(
        shard["bytes"]
        for s in ("train", "validation")
        for shard in index["splits"][s]["shards"]
    )
    return {
        "workers": workers,
        "tokens": tokens,
        "shard_bytes": shard_bytes,
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds),
    }


def reader_throughput(passes=3):
    """MB/s and documents/s of `DocumentReader` over the OpenStax training
    files (read `passes` times; the page cache holds them)."""
    from keras_mhf.data import DocumentReader

    files = common.openstax_training_files()
    size = sum(os.path.getsize(f) for f in files)
    documents = 0
    started = time.time()
    for _ in range(passes):
        documents += sum(1 for _ in DocumentReader(files))
    seconds = time.time() - started
    return {
        "megabytes_per_s": round(passes * size / 1e6 / seconds, 1),
        "documents_per_s": round(documents / seconds),
    }


def fineweb_edu_table(texts):
    """`texts` as a table with FineWeb-Edu's columns (the others filled in),
    as Parquet files on the Hub have them."""
    import pyarrow as pa

    n = len(texts)
    return pa.table(
        {
            "text": texts,
            "id": [f"<urn:uuid:{i:036d}>" for i in range(n)],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/page/{i}" for i in range(n)],
            "date": ["2024-02-21T12:00:00Z"] * n,
            "file_path": ["s3://commoncrawl/crawl-data/CC-MAIN.warc.gz"] * n,
            "language": ["en"] * n,
            "language_score": pa.array([0.95] * n, pa.float64()),
            "token_count": pa.array([len(t) // 4 for t in texts], pa.int64()),
            "score": pa.array([3.1] * n, pa.float64()),
            "int_score": pa.array([3] * n, pa.int64()),
        }
    )


def write_formats(workdir, files, row_group_rows):
    """The OpenStax training `files` written as published corpora come;
    returns `{format: inputs}` (JSONL: the files themselves)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from keras_mhf.data import read_documents

    inputs = {"jsonl": list(files), "jsonl.zst": [], "parquet": []}
    saved = os.path.join(workdir, "save_to_disk")
    os.makedirs(saved)
    shards = []
    for number, path in enumerate(files):
        name = os.path.splitext(os.path.basename(path))[0]
        zst = os.path.join(workdir, name + ".jsonl.zst")
        with open(path, "rb") as f, open(zst, "wb") as out:
            out.write(zstandard.ZstdCompressor(level=3).compress(f.read()))
        inputs["jsonl.zst"].append(zst)
        table = fineweb_edu_table(list(read_documents(path)))
        parquet = os.path.join(workdir, name + ".parquet")
        pq.write_table(table, parquet, row_group_size=row_group_rows)
        inputs["parquet"].append(parquet)
        # What `datasets`' save_to_disk writes (Arrow IPC streams of 1,000
        # rows per batch, listed in state.json), without needing `datasets`.
        shard = f"data-{number:05d}-of-{len(files):05d}.arrow"
        with pa.ipc.new_stream(os.path.join(saved, shard), table.schema) as w:
            for batch in table.to_batches(max_chunksize=1000):
                w.write_batch(batch)
        shards.append({"filename": shard})
    with open(os.path.join(saved, "state.json"), "w") as f:
        json.dump({"_data_files": shards}, f)
    with open(os.path.join(saved, "dataset_info.json"), "w") as f:
        json.dump({}, f)
    inputs["save_to_disk"] = [saved]
    return inputs


def format_throughput(workdir, passes, row_group_rows):
    """MB/s of document text and documents/s of `DocumentReader` over the
    OpenStax training text in each published format (the best of `passes`
    passes, the formats taking turns, so that the machine's other load
    weighs on each alike)."""
    from keras_mhf.data import DocumentReader
    from keras_mhf.data import read_documents

    files = common.openstax_training_files()
    texts = list(read_documents(files))
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    inputs = write_formats(workdir, files, row_group_rows)
    best = {name: float("inf") for name in inputs}
    for _ in range(passes):
        for name, paths in inputs.items():
            started = time.perf_counter()
            count = sum(1 for _ in DocumentReader(paths))
            best[name] = min(best[name], time.perf_counter() - started)
            assert count == len(texts), (name, count)
    rates = {
        name: {
            "megabytes_per_s": round(text_bytes / 1e6 / seconds, 1),
            "documents_per_s": round(len(texts) / seconds),
            "input_bytes": sum(
                os.path.getsize(p) for p in DocumentReader(inputs[name]).files
            ),
        }
        for name, seconds in best.items()
    }
    factor = best["jsonl"] / best["parquet"]
    return {
        "documents": len(texts),
        "text_bytes": text_bytes,
        "passes": passes,
        "row_group_rows": row_group_rows,
        "formats": rates,
        "parquet_over_jsonl": round(factor, 2),
        "target": PARQUET_FACTOR,
        "met": factor >= PARQUET_FACTOR,
    }


def recipe_arguments(prepared, output, steps, checkpoint_every):
    """The arguments of `keras-mhf` for a `pretrain` run."""
    return [
        "pretrain",
        "--data",
        prepared,
        "--output",
        output,
        "--tokenizer",
        MISTRAL,
        "--architecture",
        "tiny_h3b512",
        "--sequence-length",
        "128",
        "--batch-size",
        "8",
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(checkpoint_every),
        "--warmup-steps",
        "2",
        "--validation-blocks",
        "16",
        "--quiet",
    ]


def peak_rss(prepared, output, steps, env):
    command = common.keras_mhf_command(
        *recipe_arguments(prepared, output, steps, max(steps // 2, 1))
    )
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS] + command,
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["returncode"] != 0:
        raise RuntimeError("the recipe failed:\n" + report["stderr"])
    return {
        "peak_rss_mb": round(report["peak_kb"] / 1024, 1),
        "seconds": round(report["seconds"], 1),
    }


def loader_throughput(prepared, steps=2000, sequence_length=128, batch=8):
    from keras_mhf.data import window_dataset
    from keras_mhf.pretraining import loader_options

    dataset = window_dataset(
        prepared,
        "train",
        sequence_length,
        batch,
        seed=0,
        start_step=0,
        num_steps=steps,
    ).to_iter_dataset(loader_options())
    started = time.time()
    count = 0
    for x, y, _ in dataset:
        count += len(y)
    seconds = time.time() - started
    return {
        "batches": steps,
        "windows_per_s": round(count / seconds),
        "tokens_per_s": round(count * sequence_length / seconds),
    }


def model_throughput(prepared, steps=20, sequence_length=128, batch=8):
    """Training tokens/s of mini_h4b1024 (after a compiling first chunk)."""
    import keras

    from keras_mhf.data import window_dataset
    from keras_mhf.models import MultiHashFormerTokenizer
    from keras_mhf.pretraining import build_model
    from keras_mhf.pretraining import loader_options
    from keras_mhf.pretraining import make_optimizer

    keras.utils.set_random_seed(0)
    lm = build_model(
        "mhf",
        MultiHashFormerTokenizer(MISTRAL),
        "mini_h4b1024",
        sequence_length,
    )
    lm.compile(optimizer=make_optimizer(1e-3, 2 * steps, 2))
    lm.preprocessor = None

    def fit(start):
        dataset = window_dataset(
            prepared, "train", sequence_length, batch, 0, start, steps
        ).to_iter_dataset(loader_options())
        lm.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)

    fit(0)  # compiles
    started = time.time()
    fit(steps)
    seconds = time.time() - started
    return {
        "architecture": "mini_h4b1024",
        "backend": keras.config.backend(),
        "steps": steps,
        "tokens_per_s": round(steps * batch * sequence_length / seconds),
    }


def time_to_first_step(arguments, env, kill_after=None):
    """Starts the recipe; returns seconds from its start to the end of its
    first training step. With `kill_after` (a path), SIGKILLs it once that
    path exists instead of waiting for it to finish."""
    started = time.time()
    process = subprocess.Popen(
        [sys.executable, "-c", TIMED_RECIPE] + arguments,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    first = None
    try:
        for line in process.stdout:
            match = re.match(r"FIRST_STEP_DONE (\S+)", line)
            if match:
                first = float(match[1]) - started
                break
        if kill_after is not None:
            while not os.path.exists(kill_after):
                if process.poll() is not None:
                    raise RuntimeError(
                        "the run ended before its first checkpoint:\n"
                        + process.stderr.read()[-2000:]
                    )
                time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    if first is None:
        raise RuntimeError(
            "the recipe never trained:\n" + process.stderr.read()[-2000:]
        )
    return round(first, 2)


def resume_time(prepared, output, env):
    arguments = recipe_arguments(prepared, output, 400, 10)
    checkpoint = os.path.join(output, "checkpoints", "step_000010")
    fresh = time_to_first_step(arguments, env, kill_after=checkpoint)
    killed_at = sorted(os.listdir(os.path.join(output, "checkpoints")))
    resumed = time_to_first_step(arguments, env)
    started = time.time()
    subprocess.run(
        [sys.executable, "-c", "import keras_mhf.pretraining"],
        env=env,
        check=True,
        capture_output=True,
    )
    return {
        "import_s": round(time.time() - started, 2),
        "fresh_run_s": fresh,
        "killed_with_checkpoints": killed_at,
        "resumed_run_s": resumed,
        "target_s": RESUME_TARGET_S,
        "met": resumed < RESUME_TARGET_S,
    }


def test_timings(backends):
    """Wall time and pytest's summary line of `tests/pretraining` (the
    package of the pre-training tests) under each backend."""
    timings = {}
    tests = [PRETRAINING_TESTS]
    for backend in backends:
        started = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            + tests,
            capture_output=True,
            text=True,
            cwd=common.ROOT,
            env=dict(os.environ, KERAS_BACKEND=backend),
        )
        summary = done.stdout.strip().splitlines()[-1]
        timings[backend] = {
            "seconds": round(time.time() - started, 1),
            "result": summary,
        }
    return {"files": tests, "backends": timings}


def machine():
    """Cores this process may use, the CPU model and the memory."""
    from keras_mhf.data import available_cores

    model, memory = "unknown CPU", "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            kilobytes = int(f.readline().split()[1])
            memory = f"{kilobytes / 2**20:.0f} GiB"
    except OSError:
        pass
    return f"{available_cores()} cores ({model}), {memory} memory"


def main(argv=None):
    args = parse_args(argv)
    os.environ["KERAS_BACKEND"] = args.backend
    results = {}
    if os.path.exists(args.output):
        with open(args.output) as f:
            results = json.load(f)
    results["machine"] = machine()
    if args.note:
        results["note"] = args.note
    env = dict(os.environ, KERAS_BACKEND=args.backend)
    workdir = tempfile.mkdtemp(prefix="benchmark_data_", dir=args.workdir)
    started = time.time()
    try:
        prepared = {}
        if set(args.sections) & {"prepare", "rss", "loader", "resume"}:
            documents = openstax_documents()
            section = {}
            for seed, (name, megabytes) in enumerate(
                (("small", args.small_mb), ("large", args.large_mb))
            ):
                text = os.path.join(workdir, f"{name}.jsonl")
                size = synthesise(text, megabytes, documents, seed)
                runs = []
                if name == "small":
                    runs.append(prepare(text, text + ".one_worker", 1))
                    shutil.rmtree(text + ".one_worker")
                prepared[name] = os.path.join(workdir, f"{name}_prepared")
                runs.append(prepare(text, prepared[name], None))
                os.remove(text)
                section[name] = {"text_bytes": size, "runs": runs}
                print(f"prepare {name}: {runs}", flush=True)
            if "prepare" in args.sections:
                results["prepare"] = section
        if "reader" in args.sections:
            results["reader"] = reader_throughput()
            print(f"reader: {results['reader']}", flush=True)
        if "formats" in args.sections:
            folder = os.path.join(workdir, "formats")
            os.makedirs(folder)
            results["formats"] = format_throughput(
                folder, args.format_passes, args.row_group_rows
            )
            shutil.rmtree(folder)
            print(f"formats: {results['formats']}", flush=True)
        if "rss" in args.sections:
            runs = {
                name: peak_rss(
                    prepared[name],
                    os.path.join(workdir, f"rss_{name}"),
                    args.steps,
                    env,
                )
                for name in ("small", "large")
            }
            difference = round(
                abs(
                    runs["large"]["peak_rss_mb"] - runs["small"]["peak_rss_mb"]
                ),
                1,
            )
            results["rss"] = dict(
                runs,
                architecture="tiny_h3b512",
                steps=args.steps,
                backend=args.backend,
                difference_mb=difference,
                met=difference < RSS_LIMIT_MB,
            )
            print(f"rss: {results['rss']}", flush=True)
        if "loader" in args.sections:
            loader = loader_throughput(prepared["large"])
            model = model_throughput(prepared["large"])
            factor = loader["tokens_per_s"] / model["tokens_per_s"]
            results["loader"] = {
                "loader": loader,
                "model": model,
                "factor": round(factor, 1),
                "met": factor >= LOADER_FACTOR,
            }
            print(f"loader: {results['loader']}", flush=True)
        if "resume" in args.sections:
            results["resume"] = dict(
                resume_time(
                    prepared["large"], os.path.join(workdir, "resume"), env
                ),
                backend=args.backend,
            )
            print(f"resume: {results['resume']}", flush=True)
        if "tests" in args.sections:
            results["tests"] = test_timings(args.test_backends)
            print(f"tests: {results['tests']}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results.setdefault("run_seconds", {})[" ".join(args.sections)] = round(
        time.time() - started, 1
    )
    common.write_json(args.output, results)
    report = result_tables.data_report(results, RSS_LIMIT_MB, LOADER_FACTOR)
    with open(os.path.splitext(args.output)[0] + ".md", "w") as f:
        f.write(report)
    print(report)
    return results


if __name__ == "__main__":
    main()
