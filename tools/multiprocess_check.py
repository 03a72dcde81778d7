"""Multi-process data-parallel training on one machine, checked against a
single process: the pattern a multi-host launch uses, with localhost as the
coordinator and CPU collectives (gloo).

    KERAS_BACKEND=jax python tools/multiprocess_check.py

It starts 2 worker processes (2 virtual CPU devices each, so 4 devices in
all) that each call `keras_mhf.distribution.initialize("localhost:PORT", 2,
process_id)`, train the same tiny MultiHashFormer with DataParallel over the 4
devices (each process feeds its own half of every global batch), and save
their weights; then a single process trains the same model on the full
batches. It prints the largest weight difference and exits non-zero unless
both workers end with identical weights equal to the single-process run.

On real hosts, run the worker part once per host with the coordinator's
address (`initialize("10.0.0.1:1234", num_hosts, host_index)`); everything
else is unchanged.
"""

import os
import socket
import subprocess
import sys

import numpy as np

GLOBAL_BATCH, STEPS, PROCESSES = 8, 3, 2


def data():
    rng = np.random.default_rng(0)
    return rng.integers(3, 64, size=(GLOBAL_BATCH * STEPS, 9)).astype("int32")


def build():
    import keras

    from keras_mhf import SignatureTable
    from keras_mhf.models import MultiHashFormerBackbone
    from keras_mhf.models import MultiHashFormerCausalLM

    keras.utils.set_random_seed(0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(61)]
    table = SignatureTable.from_tokens(tokens, 3, 64, pad_token_id=2)
    backbone = MultiHashFormerBackbone(
        vocabulary_size=64,
        num_hashes=3,
        num_buckets=64,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        hidden_dim=32,
        intermediate_dim=64,
        gate_dim=8,
        mixer_dim=8,
        pad_token_id=2,
        signatures=table,
    )
    model = MultiHashFormerCausalLM(backbone)
    # Plain SGD: Adam would amplify float reassociation differences of
    # near-zero gradients, which is not what this check is about.
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def train(model, ids, batch_size):
    model.fit(
        {"token_ids": ids[:, :-1], "padding_mask": np.ones_like(ids[:, :-1])},
        ids[:, 1:],
        batch_size=batch_size,
        epochs=1,
        shuffle=False,
        verbose=0,
    )


def save(model, path):
    np.savez(path, *[np.asarray(v.value) for v in model.weights])


def worker(process_id, port, out):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    from keras_mhf.distribution import initialize
    from keras_mhf.distribution import make_distribution

    initialize(f"localhost:{port}", PROCESSES, process_id)
    import keras

    distribution = make_distribution("data")
    # Each process feeds its own rows of every global batch.
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)
    local = GLOBAL_BATCH // PROCESSES
    rows = np.concatenate(
        [
            np.arange(
                step * GLOBAL_BATCH + process_id * local,
                step * GLOBAL_BATCH + (process_id + 1) * local,
            )
            for step in range(STEPS)
        ]
    )
    model = build()
    train(model, data()[rows], local)
    save(model, out)


def single(out):
    model = build()
    train(model, data(), GLOBAL_BATCH)
    save(model, out)


def main(workdir=None, timeout=240):
    import tempfile

    workdir = workdir or tempfile.mkdtemp()
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, KERAS_BACKEND="jax")
    me = os.path.abspath(__file__)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                me,
                "worker",
                str(i),
                str(port),
                os.path.join(workdir, f"worker{i}.npz"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    reference = subprocess.run(
        [sys.executable, me, "single", os.path.join(workdir, "single.npz")],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            print(f"worker {i} failed:\n{out[-3000:]}")
            return 1
    if reference.returncode != 0:
        print("single process failed:\n" + reference.stderr[-3000:])
        return 1
    loaded = [
        np.load(os.path.join(workdir, f"{name}.npz"))
        for name in ("worker0", "worker1", "single")
    ]
    between_workers = max(
        float(np.abs(loaded[0][k] - loaded[1][k]).max()) for k in loaded[0]
    )
    vs_single = max(
        float(np.abs(loaded[0][k] - loaded[2][k]).max()) for k in loaded[0]
    )
    print(
        "max |weight difference|: worker 0 vs worker 1 = "
        f"{between_workers:.3g}, workers vs single process = {vs_single:.3g}"
    )
    ok = between_workers == 0.0 and vs_single < 1e-5
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "single":
        single(sys.argv[2])
    else:
        sys.exit(main())
