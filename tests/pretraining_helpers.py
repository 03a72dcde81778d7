"""Shared pieces of the pre-training tests: a small prepared corpus, the
run settings, one uninterrupted reference run per test session that the
resume and fault tests compare against bit for bit, and a compilation cache
that keeps the many identical tiny JAX models from compiling again."""

import contextlib
import functools
import json
import os

import keras
import numpy as np
import pytest
from keras import ops

from tests.conftest import CORPUS
from tests.conftest import small_proto_bytes

# Tiny, fast and deterministic; a checkpoint after every step, so that a run
# has older checkpoints to prune.
RUN = dict(
    architecture="tiny_h3b64",
    sequence_length=16,
    batch_size=4,
    steps=4,
    checkpoint_every=1,
    warmup_steps=1,
    learning_rate=5e-3,
    validation_blocks=4,
    verbose=0,
)

# The reference run: the same, with 16 validation windows, so that the 8 of
# the calibration fit hold the 100 tokens it needs (with `RUN`'s 4, a
# finished MHF run skips calibration with a warning). Validation changes no
# weight: both end with the same state.
CALIBRATED_RUN = dict(RUN, validation_blocks=16)


@contextlib.contextmanager
def stop_after_chunks(count):
    """Within the block, a run (`pretrain`, `finetune`) stops after `count`
    chunks of each call, as a run with no steps left would (its summary is
    `"incomplete"`): the `"chunk_start"` hook raises `hooks.Stop`. Other
    events go to the hook that was set before."""
    from keras_mhf.pretraining import hooks

    previous = hooks.event

    def stop(name, **info):
        if name == "chunk_start" and info["chunks"] >= count:
            raise hooks.Stop
        previous(name, **info)

    hooks.event = stop
    try:
        yield
    finally:
        hooks.event = previous


def write_documents(path, count=200, seed=1):
    """`count` JSONL documents of 1-3 sentences of the test corpus."""
    rng = np.random.default_rng(seed)
    texts = [
        " ".join(rng.choice(CORPUS, size=rng.integers(1, 4)))
        for _ in range(count)
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return str(path)


def write_tokenizer(path):
    with open(path, "wb") as f:
        f.write(small_proto_bytes())
    return str(path)


@functools.lru_cache(maxsize=None)
def prepared_corpus(root):
    """`(prepared directory, tokenizer path)` under `root`, made once."""
    from keras_mhf.data import prepare_data

    os.makedirs(root, exist_ok=True)
    documents = write_documents(os.path.join(root, "docs.jsonl"))
    tokenizer = write_tokenizer(os.path.join(root, "small.model"))
    prepared = os.path.join(root, "prepared")
    prepare_data(
        documents,
        tokenizer,
        prepared,
        validation_fraction=0.2,
        shard_tokens=2000,
        workers=1,
        progress=False,
    )
    return prepared, tokenizer


def run_flags(settings):
    """`keras-mhf pretrain` flags for keyword settings like `RUN`."""
    flags = []
    for name, value in settings.items():
        if name == "verbose":
            flags += [] if value else ["--quiet"]
        else:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def state_of(lm):
    """Numpy copies of the model weights and the optimizer variables."""
    variables = list(lm.weights) + list(lm.optimizer.variables)
    return [np.array(ops.convert_to_numpy(v.value)) for v in variables]


@functools.lru_cache(maxsize=None)
def reference_run(root):
    """`(state, output directory)` of an uninterrupted, calibrated run of
    `CALIBRATED_RUN` on the prepared corpus, made once per session. It keeps
    every checkpoint (not only the last `KEEP_CHECKPOINTS`), for tests that
    start from one."""
    from keras_mhf.pretraining import checkpoints
    from keras_mhf.pretraining import pretrain

    prepared, _ = prepared_corpus(os.path.join(root, "corpus"))
    output = os.path.join(root, "reference")
    keep = checkpoints.KEEP_CHECKPOINTS
    checkpoints.KEEP_CHECKPOINTS = RUN["steps"]
    try:
        lm, summary = pretrain(prepared, output, **CALIBRATED_RUN)
    finally:
        checkpoints.KEEP_CHECKPOINTS = keep
    assert summary["finished"]
    return state_of(lm), output


_CACHE_OPTIONS = {
    "jax_compilation_cache_dir": None,
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


@contextlib.contextmanager
def compilation_cache(directory):
    """On JAX, a persistent compilation cache in `directory` while the
    context lasts (the previous settings are restored): every run of these
    tests builds a new tiny model, and compiling its training and scoring
    steps again would take most of their time. Identical computations give
    identical executables, so results do not change. Subprocesses get the
    same cache through `compilation_cache_env`."""
    if keras.config.backend() != "jax":
        yield
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    options = dict(_CACHE_OPTIONS, jax_compilation_cache_dir=str(directory))
    previous = {name: getattr(jax.config, name) for name in options}
    for name, value in options.items():
        jax.config.update(name, value)
    cc.reset_cache()
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        cc.reset_cache()


def compilation_cache_env(directory):
    """Environment of a subprocess that shares `compilation_cache`."""
    env = dict(os.environ)
    if keras.config.backend() == "jax":
        options = dict(_CACHE_OPTIONS, jax_compilation_cache_dir=directory)
        env.update({k.upper(): str(v) for k, v in options.items()})
    return env


def checkpoint_variables(directory):
    """`{"model/00000": numpy value, ...}`: the variables of a checkpoint
    directory (`checkpoint_store.read_variables`), flat."""
    from keras_mhf.pretraining.checkpoint_store import read_variables

    return {
        f"{group}/{key}": value
        for group, found in read_variables(directory).items()
        for key, value in found.items()
    }


def weights_in(path):
    """`{dataset name: numpy value}` of a Keras `.weights.h5` file."""
    import h5py

    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, item: (
                found.__setitem__(name, item[()])
                if isinstance(item, h5py.Dataset)
                else None
            )
        )
    return found


def assert_same_state(found, expected):
    assert len(found) == len(expected)
    for a, b in zip(found, expected):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module", autouse=True, name="_compile_once")
def compile_once_fixture(tmp_path_factory):
    """Module fixture `_compile_once` (import it into a test module):
    `compilation_cache` in the session's base directory, shared by every
    pre-training test module and their subprocesses."""
    with compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.fixture(scope="module", name="corpus")
def corpus_fixture(tmp_path_factory):
    """Module fixture `corpus` (import it into a test module): the
    `prepared_corpus` of the session's base directory, the same one in every
    pre-training test module."""
    return prepared_corpus(str(tmp_path_factory.getbasetemp() / "corpus"))
