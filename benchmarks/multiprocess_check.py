"""Multi-process pre-training with the weights split across processes
(fully sharded data parallelism, `--distribution fsdp`), from a prepared
corpus on one machine, checked against a single process: the pattern a
multi-host launch uses, with localhost as the coordinator and CPU
collectives (gloo).

    KERAS_BACKEND=jax python -m benchmarks.multiprocess_check

The single process prepares a tiny corpus (a SentencePiece tokenizer
trained on generated sentences, `keras_mhf.data.prepare_data` into small
shards, so windows cross them), then pre-trains a tiny MultiHashFormer on it
on one device. Jobs of 2 worker processes (4 virtual CPU devices each, 8 in
all) join one JAX job exactly as `keras-mhf pretrain --coordinator
localhost:PORT --num-processes 2 --process-id I` does (its
`join_processes`) and run the same `pretrain` with `distribution="fsdp"`:
every weight and its AdamW state are split along the batch axis, which
spans both processes, and each process streams only its own rows of every
global batch. Three jobs run: an uninterrupted one; one whose process 1 is
SIGKILLed while checkpoint 2 is written (process 0 must then stop by
itself within seconds, in one line naming process 1), restarted to the end;
and the killed job's step-1
checkpoint resumed by one process on one device. It checks, and prints:

- each process holds only its shards (about half of the bytes);
- what the two workers read is disjoint and, put together, is exactly what
  the single process reads (the token windows of every step);
- the job ends with the single process's weights and optimizer state
  (1e-5; float sums are reassociated across devices) and validation loss;
- every process wrote its own shards of each checkpoint (Orbax), process 0
  the log and preset;
- the restarted job ends with the uninterrupted job's weights, to the bit;
- the checkpoint moved from 8 devices to 1 ends within 1e-5 of the single
  process.

It exits non-zero unless all hold. On real hosts, run the recipe once per
host with the coordinator's address (`keras-mhf pretrain ... --distribution
fsdp --coordinator 10.0.0.1:1234 --num-processes N --process-id I`).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import common

PROCESSES, DEVICES_PER_PROCESS, SEQUENCE_LENGTH = 2, 4, 16
# Fully sharded data parallelism: the weights and the optimizer state are
# split along the batch axis, which spans both processes.
LAYOUT = "fsdp"
KILL_STEP = 2
LOST_PEER_TIMEOUT_S = 30  # JAX alone would wait 100 s, then abort in C++
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
SENTENCES = common.SENTENCES[:6]


def prepare(workdir):
    """A tiny prepared corpus and its tokenizer under `workdir`; returns the
    prepared directory."""
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
        f.write(common.small_sentencepiece(SENTENCES, vocabulary_size=100))
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


def host_value(variable):
    """A variable's whole value in numpy (gathered from every process when
    it is split across them; every process must call it)."""
    import jax
    from jax.experimental import multihost_utils

    value = variable.value
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(value)


def local_bytes(variables):
    """`(bytes of the shards this process holds, bytes of the variables)`,
    counting each shard once (replicas on several local devices too)."""
    local = total = 0
    for variable in variables:
        value = variable.value
        total += value.size * value.dtype.itemsize
        held = {
            str(shard.index): shard.data.size * value.dtype.itemsize
            for shard in value.addressable_shards
        }
        local += sum(held.values())
    return local, total


def train_and_save(prepared, output, out, distribution):
    from keras_mhf.pretraining import pretrain

    lm, summary = pretrain(
        prepared, output, distribution=distribution, **SETTINGS
    )
    variables = list(lm.weights) + list(lm.optimizer.variables)
    local, total = local_bytes(variables)
    np.savez(
        out,
        windows=windows_read(prepared),
        validation=np.array(summary["validation"]["loss"]),
        finished=np.array(summary["finished"]),
        local_bytes=np.array([local, total]),
        **{f"variable_{i}": host_value(v) for i, v in enumerate(variables)},
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
    problem = recipe.join_processes(
        args.coordinator, args.num_processes, args.process_id
    )
    if problem:
        raise SystemExit(problem)


def worker(process_id, port, workdir, job, kill):
    """A process of a 2-process job writing `workdir/job`; `kill`
    ("EVENT:STEP" or "none") SIGKILLs it at that checkpoint event."""
    # Added to the caller's XLA_FLAGS, which the workers keep as the single
    # process does (tools/test.sh's optimisation level 0 halved this check).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    )
    join(port, process_id)
    if os.environ.get("MULTIPROCESS_CHECK_TRACE"):  # where a hung job waits
        import faulthandler

        faulthandler.dump_traceback_later(
            float(os.environ["MULTIPROCESS_CHECK_TRACE"]), exit=True
        )
    if kill != "none":
        from keras_mhf.pretraining import hooks

        event, step = kill.split(":")

        def die(name, path=None, **info):
            if name == event and f"step_{int(step):06d}" in str(path):
                os.kill(os.getpid(), signal.SIGKILL)

        hooks.event = die
    prepared = os.path.join(workdir, "prepared")
    wait_for(os.path.join(prepared, "index.json"))
    train_and_save(
        prepared,
        os.path.join(workdir, job),
        os.path.join(workdir, f"{job}{process_id}.npz"),
        LAYOUT,
    )


def single(workdir, output="single"):
    """The reference: one process, one device (also a run moved there)."""
    prepared = os.path.join(workdir, "prepared")
    if output == "single":
        prepare(workdir)
    train_and_save(
        prepared,
        os.path.join(workdir, output),
        os.path.join(workdir, f"{output}.npz"),
        None,
    )


def largest_difference(a, b):
    names = [k for k in a.files if k.startswith("variable_")]
    return max(float(np.abs(a[k] - b[k]).max()) for k in names)


def compare(workdir):
    """Prints the checks; returns True when all hold."""
    run = {
        name: np.load(os.path.join(workdir, f"{name}.npz"))
        for name in ("job0", "job1", "single", "resumed0", "resumed1", "moved")
    }
    batch, steps = SETTINGS["batch_size"], SETTINGS["steps"]
    local = batch // PROCESSES
    union = np.concatenate([run["job0"]["windows"], run["job1"]["windows"]], 1)
    same_windows = run["job0"]["windows"].shape == (
        steps,
        local,
        SEQUENCE_LENGTH + 1,
    ) and np.array_equal(union, run["single"]["windows"])
    disjoint = not np.array_equal(
        run["job0"]["windows"], run["job1"]["windows"]
    )
    held = [run[f"job{i}"]["local_bytes"] for i in range(PROCESSES)]
    between_workers = largest_difference(run["job0"], run["job1"])
    vs_single = largest_difference(run["job0"], run["single"])
    after_kill = max(
        largest_difference(run[f"resumed{i}"], run[f"job{i}"])
        for i in range(PROCESSES)
    )
    moved = largest_difference(run["moved"], run["single"])
    validation = [
        float(run[k]["validation"]) for k in ("job0", "job1", "single")
    ]
    job = os.path.join(workdir, "job")
    checkpoints = sorted(os.listdir(os.path.join(job, "checkpoints")))
    shards = sorted(
        name
        for name in os.listdir(
            os.path.join(job, "checkpoints", checkpoints[-1], "variables")
        )
        if name.startswith("ocdbt.process_")
    )
    with open(os.path.join(job, "log.csv")) as f:
        log_rows = len(f.read().splitlines()) - 1
    written_once = (
        checkpoints == ["step_000001", "step_000002"]
        and log_rows == steps
        and os.path.exists(os.path.join(job, "preset", "config.json"))
    )
    print(
        f"layout: {LAYOUT!r}, {PROCESSES} processes x {DEVICES_PER_PROCESS} "
        "devices; bytes of weights and optimizer state each process holds: "
        + ", ".join(f"{h[0]:,} of {h[1]:,}" for h in held)
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
        f"files of the job: checkpoints {checkpoints} (shards written by "
        f"{shards}), {log_rows} log rows, preset written: {written_once}"
    )
    print(
        "process 1 SIGKILLed while checkpoint 2 was written, the job "
        f"restarted: max difference to the uninterrupted job = {after_kill:.3g}"
    )
    print(
        f"the killed job's step-1 checkpoint ({PROCESSES * DEVICES_PER_PROCESS}"
        " devices) resumed in one process on one device: max difference to "
        f"the single process = {moved:.3g}"
    )
    return (
        all(bool(r["finished"]) for r in run.values())
        and same_windows
        and disjoint
        and all(h[0] < 0.75 * h[1] for h in held)
        and between_workers == 0.0
        and vs_single < 1e-5
        and validation[0] == validation[1]
        and abs(validation[0] - validation[2]) < 1e-4
        and written_once
        and shards == [f"ocdbt.process_{i}" for i in range(PROCESSES)]
        and after_kill == 0.0
        and moved < 1e-5
    )


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(workdir, command):
    return subprocess.Popen(
        common.module_command("multiprocess_check", *command, workdir),
        cwd=common.ROOT,
        env=dict(os.environ, KERAS_BACKEND="jax"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def job(workdir, name, kill="none"):
    """The commands of the 2 processes of a job."""
    port = str(free_port())
    return [
        ["worker", str(i), port, name, kill if i == 1 else "none"]
        for i in range(PROCESSES)
    ]


def finish(procs, timeout):
    """Waits for every process; `None` when all exited 0, else the failure."""
    for command, proc in procs:
        out = proc.communicate(timeout=timeout)[0]
        if proc.returncode != 0:
            return f"{' '.join(command[:2])} failed:\n{out[-3000:]}"
    return None


def killed_job(workdir, timeout):
    """Process 1 dies (SIGKILL) while checkpoint 2 is written; process 0
    stops by itself, saying so in one line."""
    commands = job(workdir, "resumed", f"checkpoint_started:{KILL_STEP}")
    procs = [(c, launch(workdir, c)) for c in commands]
    procs[1][1].communicate(timeout=timeout)
    if procs[1][1].returncode != -signal.SIGKILL:
        return "process 1 was not killed"
    # Process 0 stops by itself within seconds, in one line (PeerWatch).
    killed = time.monotonic()
    try:
        out = procs[0][1].communicate(timeout=LOST_PEER_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        procs[0][1].kill()
        return f"process 0 still ran {LOST_PEER_TIMEOUT_S} s after the kill"
    stopped = time.monotonic() - killed
    lines = [line for line in out.splitlines() if "was lost" in line]
    if procs[0][1].returncode != 1 or len(lines) != 1 or "Traceback" in out:
        return (
            f"process 0 exited {procs[0][1].returncode}; it should end in one "
            f"line saying process 1 was lost:\n{out[-3000:]}"
        )
    print(f"process 0 stopped {stopped:.1f} s after the kill: {lines[0]}")
    root = os.path.join(workdir, "resumed", "checkpoints")
    complete = [n for n in sorted(os.listdir(root)) if n.startswith("step_")]
    complete = [n for n in complete if "orbax" not in n]
    if complete != [f"step_{KILL_STEP - 1:06d}"]:
        return f"after the kill the checkpoints are {complete}"
    # The same checkpoint, moved to a single process of one device.
    shutil.copytree(
        os.path.join(workdir, "resumed"),
        os.path.join(workdir, "moved"),
        ignore=shutil.ignore_patterns("*.lock"),
    )
    return None


def main(workdir=None, timeout=300):
    """Runs the jobs and the checks in `workdir` (default: a temporary
    folder, removed at the end); 0 when all hold, else 1."""
    own = workdir is None
    workdir = os.path.abspath(
        workdir or tempfile.mkdtemp(prefix="multiprocess_check_")
    )
    try:
        phases = [
            lambda: [["single"]] + job(workdir, "job"),
            lambda: killed_job(workdir, timeout),
            lambda: job(workdir, "resumed") + [["single", "moved"]],
        ]
        for phase in phases:
            commands = phase()
            if isinstance(commands, str):
                print(commands)
                return 1
            if commands is None:
                continue
            problem = finish(
                [(c, launch(workdir, c)) for c in commands], timeout
            )
            if problem:
                print(problem)
                return 1
        ok = compare(workdir)
        print("OK" if ok else "MISMATCH")
        return 0 if ok else 1
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def command_line(argv=None):
    """`python -m benchmarks.multiprocess_check [--workdir DIR] [--timeout
    S]`; the processes it starts run `worker ...` and `single ...`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "worker":  # worker ID PORT JOB KILL WORKDIR
        return worker(int(argv[1]), argv[2], argv[5], *argv[3:5])
    if argv and argv[0] == "single":  # single [OUTPUT] WORKDIR
        return single(argv[-1], *argv[1:-1])
    p = common.argument_parser(
        "multiprocess_check",
        __doc__,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="where the jobs write, kept afterwards (default: a temporary "
        "folder, removed at the end)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300,
        help="seconds each process of a job may take",
    )
    args = p.parse_args(argv)
    return main(args.workdir, args.timeout)


if __name__ == "__main__":
    sys.exit(command_line())
