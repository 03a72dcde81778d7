import functools
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from benchmarks.common import SENTENCES
from benchmarks.common import small_sentencepiece

keras.config.disable_traceback_filtering()

REPO = Path(__file__).resolve().parents[1]
# The small data files the tests read, in the repository (each folder's
# SOURCE.md says where they come from and under which licence).
DATA = REPO / "tests" / "testdata"
MISTRAL_MODEL = DATA / "mistral_v03_tokenizer" / "tokenizer.model"
OPENSTAX = DATA / "openstax_edu_en"


def run_script(script, *args, timeout=600, env=None):
    """Runs one of the repository's scripts (`recipes/...`,
    `benchmarks/*.sh`; `.sh` under bash, else this Python) with `args`,
    fails the test with the end of its output unless it exits 0, and
    returns the finished process (`stdout`, `stderr` as text)."""
    program = ["bash"] if script.endswith(".sh") else [sys.executable]
    return _run_to_success(program + [str(REPO / script)], args, timeout, env)


def run_module(module, *args, timeout=600, env=None):
    """Runs `python -m MODULE ARGS` (e.g. `benchmarks.benchmark`,
    `keras_mhf.cli.main`) in this Python from the repository root, fails the
    test with the end of its output unless it exits 0, and returns the
    finished process (`stdout`, `stderr` as text)."""
    command = [sys.executable, "-m", module]
    return _run_to_success(command, args, timeout, env, cwd=REPO)


def _run_to_success(command, args, timeout, env, cwd=None):
    done = subprocess.run(
        command + [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def assert_greedy_continuation(lm, prompt="The cell", length=8):
    """Greedy `lm.generate(prompt)` (no stop token) continues the prompt
    with the argmax of the model's own scores at every new position, checked
    against one uncached causal pass over the generated row; returns `(ids,
    start)`: the row's token ids and the first generated position. The task
    is recompiled with the greedy sampler."""
    from keras import ops

    lm.compile(sampler="greedy")
    preprocessor = lm.preprocessor
    x = preprocessor.generate_preprocess([prompt], sequence_length=length)
    lm.preprocessor = None  # generate on the prompt's token ids
    try:
        out = lm.generate(x, stop_token_ids=None)
        ids = np.asarray(ops.convert_to_numpy(out["token_ids"]))[0]
        log_probs = np.asarray(ops.convert_to_numpy(lm.score(ids[None])))[0]
    finally:
        lm.preprocessor = preprocessor
    start = int(np.sum(ops.convert_to_numpy(x["padding_mask"])[0]))
    assert 0 < start < length, (start, length)
    for position in range(start, length):
        assert ids[position] == int(np.argmax(log_probs[position - 1]))
    return ids, start


def pytest_addoption(parser):
    parser.addoption(
        "--run_large",
        action="store_true",
        default=False,
        help="run large tests",
    )


# The backend whose pass runs the tests that run once (below): PyTorch,
# whose tiny models need no compiling, so the same tests take the least time
# there (under JAX they were 240 s more of its pass). MHF_ONCE_BACKEND
# chooses another.
ONCE_BACKEND = os.environ.get("MHF_ONCE_BACKEND", "torch")

# Test modules whose code under test never touches a Keras backend (numpy,
# SentencePiece, files, the import graph): the suite runs once per backend,
# these only in the `ONCE_BACKEND` pass, since the others would repeat them.
BACKEND_INDEPENDENT = {
    "test_data_documents.py",
    "test_published_corpora.py",
    "test_docstring_examples.py",
    "test_package_structure.py",
    "test_prepare_data.py",
    "test_signature_lsh.py",
    "test_signature_table.py",
    "test_task_files.py",
    "test_task_formats.py",
    "test_compare_optimizers.py",
    "test_run_settings.py",
    # The command line's argument handling and one smoke run per subcommand;
    # the functions behind them are tested on every backend.
    "test_cli.py",
    "test_quickstart.py",
    "test_peer_watch.py",
    "test_docs_commands.py",
    "test_docs_commands_standalone.py",
}

# Tests whose work runs in processes that choose their own backend (a
# TensorFlow-only process loading an export; a command-line tool or recipe)
# after a short in-process part that other tests already run on every
# backend: they too run only in the `ONCE_BACKEND` pass.
ONCE_PER_SUITE = {
    "test_pretraining_reliability.py::"
    "test_a_file_size_limit_during_a_background_write_is_one_clear_line",
    "test_lm_eval_adapter.py::test_lm_eval_agrees_with_us_on_the_ten_tasks",
    # lm-eval's own process talking to the server; the server's log-probs
    # are checked on every backend in the same module.
    "test_server.py::test_lm_eval_local_completions_gives_evaluates_numbers",
    "test_vocabulary_expansion.py::test_recipe_on_shared_data",
    "test_evaluation.py::test_evaluate_recipe_end_to_end",
    # Whether importing keras_mhf patches KerasHub's Qwen3 is a question of
    # Python modules, not of the backend.
    "test_qwen3_decoder_block.py::"
    "test_importing_keras_mhf_leaves_stock_qwen3_unchanged",
    # The README's and docs' examples use the public API, which the rest of
    # the suite checks on every backend.
    "test_docs.py::test_python_examples_run",
    # What a checkpoint's files hold and which one a run resumes from is
    # decided by files and Orbax, whatever the backend (every backend's
    # resume is checked bit for bit in test_pretraining.py, and its
    # non-finite checks and 0.1 checkpoints in test_pretraining_faults.py).
    "test_pretraining_faults.py::"
    "test_a_run_killed_at_every_point_of_a_checkpoint_write_resumes_exactly",
    "test_pretraining_faults.py::"
    "test_damaged_newer_checkpoints_fall_back_to_the_last_good_one",
    "test_pretraining_faults.py::"
    "test_an_edited_state_json_makes_its_checkpoint_unusable",
    "test_pretraining_faults.py::"
    "test_no_usable_checkpoint_is_a_clear_error_not_a_fresh_start",
    # The measurement script's smoke run: the accumulation it measures is
    # tested on every backend in tests/pretraining/test_gradient_accumulation.py.
    "test_accumulation_memory.py::test_accumulation_memory_smoke",
}

# SavedModel tests whose point is the SavedModel (what a process with only
# TensorFlow loads and serves): they run once, in the TensorFlow pass, which
# exports in its own process; JAX and PyTorch export through a TensorFlow
# subprocess, which test_export.py's text-endpoints test checks on every
# backend.
ONCE_UNDER_TENSORFLOW = {
    "test_export.py::test_ids_only_exports_load_with_tensorflow_alone",
    "test_quantization.py::test_quantized_savedmodel_export",
}


# The modules that take longest in some pass, in that order: they start
# first, so that pytest-xdist's `--dist loadfile` (a module at a time per
# worker, in collection order) does not end a pass with one worker still in
# a long module while the other waits (longest first). From the
# `--durations` of CI runs; a stale order costs time, never a result.
LONGEST_FIRST = (
    "test_docs_commands.py",
    "test_docs_commands_standalone.py",
    "test_benchmark_inference.py",
    "test_benchmark_training.py",
    "test_distribution.py",
    "test_stop_signals.py",
    "test_replicate.py",
    "test_server.py",
    "test_pretraining_faults.py",
    "test_generation_stream.py",
    "test_docs.py",
    "test_pretraining.py",
    "test_multi_hash_former_causal_lm.py",
    "test_export.py",
    "test_fused_signature_loss.py",
    "test_evaluation.py",
    "test_quantization.py",
    "test_pretraining_reliability.py",
    "test_precision.py",
    "test_gradient_accumulation.py",
    "test_training_curves.py",
    "test_vocabulary_expansion.py",
)


def _runs_once(item):
    name = f"{item.path.name}::{item.originalname}"
    return item.path.name in BACKEND_INDEPENDENT or name in ONCE_PER_SUITE


def _runs_under_tensorflow_only(item):
    return f"{item.path.name}::{item.originalname}" in ONCE_UNDER_TENSORFLOW


def _tensorflow_session_helper(item):
    """TensorFlow's `TestCase.test_session` (a helper under KerasHub's
    `TestCase`, not a test) that pytest collects from every test class built
    on it, and from the imported `TestCase` itself."""
    cls = getattr(item, "cls", None)
    return (
        item.name == "test_session"
        and cls is not None
        and not any(
            "test_session" in vars(c)
            for c in cls.__mro__
            if c.__module__.startswith("tests.")
        )
    )


def pytest_collection_modifyitems(config, items):
    helpers = [item for item in items if _tensorflow_session_helper(item)]
    if helpers:
        config.hook.pytest_deselected(items=helpers)
        items[:] = [item for item in items if item not in helpers]
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if keras.config.backend() != ONCE_BACKEND:
        once = pytest.mark.skip(
            reason="backend-independent: runs once, under "
            f"KERAS_BACKEND={ONCE_BACKEND}"
        )
        for item in items:
            if _runs_once(item):
                item.add_marker(once)
    if keras.config.backend() != "tensorflow":
        once = pytest.mark.skip(
            reason="a SavedModel's own test: runs once, under "
            "KERAS_BACKEND=tensorflow"
        )
        for item in items:
            if _runs_under_tensorflow_only(item):
                item.add_marker(once)
    if config.getoption("--run_large"):
        return
    skip = pytest.mark.skip(reason="large test: pass --run_large to run it")
    for item in items:
        if "large" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mistral_model_path():
    return str(MISTRAL_MODEL)


@pytest.fixture(scope="session")
def mistral_pieces(mistral_model_path):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=mistral_model_path)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


@pytest.fixture(scope="session")
def openstax_dir():
    return OPENSTAX


@pytest.fixture(autouse=True)
def _reset_dtype_policy():
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True)
def _reset_progress():
    """Recipes run in-process turn progress reporting on for the process
    (`show_progress`); every test starts from the library default."""
    from keras_mhf.utils.progress import show_progress

    show_progress(False)
    yield
    show_progress(False)


# The tiny corpus and SentencePiece model are the measurement scripts' own
# (benchmarks/common.py), so both train the same tokenizer.
CORPUS = SENTENCES * 4


@pytest.fixture(scope="session")
def corpus():
    return list(CORPUS)


@functools.lru_cache(maxsize=None)
def small_proto_bytes():
    """A SentencePiece model trained here on a few sentences (no data files);
    for `TestCase` classes, which cannot take fixtures."""
    return small_sentencepiece(CORPUS, vocabulary_size=120)


@pytest.fixture(scope="session")
def small_proto():
    return small_proto_bytes()


@pytest.fixture
def small_tokenizer(small_proto):
    from keras_mhf.models import MultiHashFormerTokenizer

    return MultiHashFormerTokenizer(small_proto)


@pytest.fixture
def tiny_lm(small_tokenizer):
    from keras_mhf.models import MultiHashFormerCausalLM

    keras.utils.set_random_seed(0)
    return MultiHashFormerCausalLM.from_tokenizer(
        small_tokenizer, "tiny_h3b64", sequence_length=16
    )
