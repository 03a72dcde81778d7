"""Multi-process data-parallel pre-training from a prepared corpus on one
machine, checked against a single process: the pattern a multi-host launch
uses, with localhost as the coordinator and CPU collectives (gloo).

    KERAS_BACKEND=jax python tools/multiprocess_check.py

It starts three processes at once. The single process prepares a tiny corpus
(a SentencePiece tokenizer trained on generated sentences,
`keras_mhf.data.prepare_data` into small shards, so windows cross them), then
pre-trains a tiny MultiHashFormer on it with `keras_mhf.pretraining.pretrain`
on one device. The 2 workers (2 virtual CPU devices each, 4 devices in all)
join one JAX job exactly as `keras-mhf pretrain --coordinator
localhost:PORT --num-processes 2 --process-id I` does (its `join_processes`),
wait for the prepared corpus and run the same `pretrain` with `distribution=
"data"`: each streams only its own rows of every global batch. It checks, and
prints:

- what the two workers read is disjoint and, put together, is exactly what
  the single process reads (the token windows of every step);
- both workers end with identical weights and optimizer state, equal to the
  single process's (1e-5; float sums are reassociated across devices);
- both score the same validation loss as the single process;
- process 0 alone wrote the checkpoints, log and preset.

It exits non-zero unless all hold. On real hosts, run the recipe once per
host with the coordinator's address (`keras-mhf pretrain ... --distribution
data --coordinator 10.0.0.1:1234 --num-processes N --process-id I`).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES, SEQUENCE_LENGTH = 2, 16
SETTINGS = dict(
    architecture="tiny_h3b64",
    sequence_length=SEQUENCE_LENGTH,
    batch_size=8,
    steps=2,
    checkpoint_every=1,
    warmup_steps=1,
    validation_blocks=4,
    seed=0,
    compilation_cache="none",
    verbose=0,
)
SENTENCES = [
    "The cell is the basic unit of life and every organism is made of cells.",
    "Energy is conserved in a closed system, so work and heat balance out.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "A market price rises when demand grows faster than supply.",
    "The mitochondria release energy that the cell uses to do work.",
    "Light travels faster than sound, which is why thunder comes later.",
]


def prepare(workdir):
    """A tiny prepared corpus and its tokenizer under `workdir`; returns the
    prepared directory."""
    import sentencepiece as spm

    from keras_mhf.data import prepare_data

    rng = np.random.default_rng(0)
    texts = [
        " ".join(rng.choice(SENTENCES, size=rng.integers(1, 4)))
        for _ in range(300)
    ]
    corpus = os.path.join(workdir, "docs.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tokenizer = os.path.join(workdir, "tokenizer.model")
    with open(tokenizer, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(SENTENCES),
            model_writer=f,
            vocab_size=100,
            model_type="bpe",
            minloglevel=2,
        )
    prepared = os.path.join(workdir, "prepared")
    prepare_data(
        corpus,
        tokenizer,
        prepared,
        validation_fraction=0.2,
        shard_tokens=1000,
        workers=1,
        progress=False,
    )
    return prepared


def wait_for(path, timeout=240):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s.")
        time.sleep(0.1)


def windows_read(prepared):
    """The token windows `[steps, local batch, L + 1]` this process reads:
    the dataset `train_chunk` builds for its place in the job."""
    from keras_mhf.data import window_dataset
    from keras_mhf.pretraining import process_layout

    process_index, process_count = process_layout()
    dataset = window_dataset(
        prepared,
        "train",
        SEQUENCE_LENGTH,
        SETTINGS["batch_size"],
        SETTINGS["seed"],
        start_step=0,
        num_steps=SETTINGS["steps"],
        process_index=process_index,
        process_count=process_count,
    )
    batches = [dataset[k] for k in range(len(dataset))]
    return np.stack(
        [np.concatenate([x["token_ids"], y[:, -1:]], 1) for x, y, _ in batches]
    )


def train_and_save(prepared, output, out, distribution):
    from keras import ops

    from keras_mhf.pretraining import pretrain

    lm, summary = pretrain(
        prepared, output, distribution=distribution, **SETTINGS
    )
    variables = list(lm.weights) + list(lm.optimizer.variables)
    np.savez(
        out,
        windows=windows_read(prepared),
        validation=np.array(summary["validation"]["loss"]),
        finished=np.array(summary["finished"]),
        **{
            f"variable_{i}": np.asarray(ops.convert_to_numpy(v.value))
            for i, v in enumerate(variables)
        },
    )


def join(port, process_id):
    """Joins the job through the recipe's own flag handling."""
    from keras_mhf.cli import pretrain as recipe

    args = recipe.build_parser().parse_args(
        [
            "--data",
            "unused",
            "--output",
            "unused",
            "--coordinator",
            f"localhost:{port}",
            "--num-processes",
            str(PROCESSES),
            "--process-id",
            str(process_id),
        ]
    )
    problem = recipe.join_processes(args)
    if problem:
        raise SystemExit(problem)


def worker(process_id, port, workdir):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    join(port, process_id)
    prepared = os.path.join(workdir, "prepared")
    wait_for(os.path.join(prepared, "index.json"))
    train_and_save(
        prepared,
        os.path.join(workdir, "job"),
        os.path.join(workdir, f"worker{process_id}.npz"),
        "data",
    )


def single(workdir):
    prepared = prepare(workdir)
    train_and_save(
        prepared,
        os.path.join(workdir, "single"),
        os.path.join(workdir, "single.npz"),
        None,
    )


def compare(workdir):
    """Prints the checks; returns True when all hold."""
    runs = [
        np.load(os.path.join(workdir, f"{name}.npz"))
        for name in ("worker0", "worker1", "single")
    ]
    names = [k for k in runs[0].files if k.startswith("variable_")]
    batch, steps = SETTINGS["batch_size"], SETTINGS["steps"]
    local = batch // PROCESSES
    union = np.concatenate([runs[0]["windows"], runs[1]["windows"]], 1)
    same_windows = runs[0]["windows"].shape == (
        steps,
        local,
        SEQUENCE_LENGTH + 1,
    ) and np.array_equal(union, runs[2]["windows"])
    disjoint = not np.array_equal(runs[0]["windows"], runs[1]["windows"])
    between_workers = max(
        float(np.abs(runs[0][k] - runs[1][k]).max()) for k in names
    )
    vs_single = max(float(np.abs(runs[0][k] - runs[2][k]).max()) for k in names)
    validation = [float(r["validation"]) for r in runs]
    job = os.path.join(workdir, "job")
    checkpoints = sorted(os.listdir(os.path.join(job, "checkpoints")))
    with open(os.path.join(job, "log.csv")) as f:
        log_rows = len(f.read().splitlines()) - 1
    written_once = (
        checkpoints == ["step_000001", "step_000002"]
        and log_rows == steps
        and os.path.exists(os.path.join(job, "preset", "config.json"))
    )
    print(
        f"windows: each worker read {local} of the {batch} rows of each of "
        f"{steps} global batches; worker 0 + worker 1 == single process: "
        f"{same_windows}; the workers' rows differ: {disjoint}"
    )
    print(
        "max |weight or optimizer state difference|: worker 0 vs worker 1 = "
        f"{between_workers:.3g}, workers vs single process = {vs_single:.3g}"
    )
    print(
        "validation NLL: "
        + ", ".join(f"{v:.6f}" for v in validation)
        + " (worker 0, worker 1, single)"
    )
    print(
        f"files of the job: checkpoints {checkpoints}, {log_rows} log rows, "
        f"preset written: {written_once}"
    )
    return (
        all(bool(r["finished"]) for r in runs)
        and same_windows
        and disjoint
        and between_workers == 0.0
        and vs_single < 1e-5
        and validation[0] == validation[1]
        and abs(validation[0] - validation[2]) < 1e-4
        and written_once
    )


def main(workdir=None, timeout=240):
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="multiprocess_check_")
    try:
        env = dict(os.environ, KERAS_BACKEND="jax")
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        me = os.path.abspath(__file__)
        commands = [["single", workdir]] + [
            ["worker", str(i), str(port), workdir] for i in range(PROCESSES)
        ]
        procs = [
            subprocess.Popen(
                [sys.executable, me] + command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for command in commands
        ]
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        for command, p, out in zip(commands, procs, outputs):
            if p.returncode != 0:
                print(f"{' '.join(command[:2])} failed:\n{out[-3000:]}")
                return 1
        ok = compare(workdir)
        print("OK" if ok else "MISMATCH")
        return 0 if ok else 1
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "single":
        single(sys.argv[2])
    else:
        sys.exit(main())
