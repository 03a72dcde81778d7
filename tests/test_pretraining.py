import os
import subprocess
import sys

import numpy as np
from keras import ops

from keras_mhf.data import pack_documents
from keras_mhf.data import read_documents
from keras_mhf.pretraining import pretrain
from tests.conftest import REPO

RUN = dict(
    vocabulary_size=400,
    architecture="tiny_h3b64",
    sequence_length=16,
    batch_size=4,
    steps=6,
    checkpoint_every=2,
    warmup_steps=2,
    learning_rate=5e-3,
    verbose=0,
)


def write_corpus(tmp_path, corpus):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(corpus))
    return str(path)


def test_packing_puts_bos_between_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a b"}\n{"text": "c"}\n\n{"text": "d e f"}\n')
    docs = list(read_documents(str(path)))
    assert docs == ["a b", "c", "d e f"]
    blocks = pack_documents(
        docs, lambda t: [ord(c) for c in t.replace(" ", "")], 1, 3
    )
    assert blocks.tolist() == [[1, 97, 98, 1], [99, 1, 100, 101]]


def test_resume_after_a_crash_gives_identical_weights(tmp_path, corpus):
    data = write_corpus(tmp_path, corpus)
    full_lm, full = pretrain(data, str(tmp_path / "full"), **RUN)
    tokenizer = os.path.join(tmp_path, "full", "tokenizer.model")
    _, crashed = pretrain(
        data,
        str(tmp_path / "resumed"),
        tokenizer=tokenizer,
        stop_after_chunks=1,
        **RUN,
    )
    assert not crashed["finished"]
    resumed_lm, resumed = pretrain(
        data, str(tmp_path / "resumed"), tokenizer=tokenizer, **RUN
    )
    assert resumed["finished"]
    for a, b in zip(full_lm.weights, resumed_lm.weights):
        np.testing.assert_array_equal(
            ops.convert_to_numpy(a), ops.convert_to_numpy(b)
        )
    for name in ("log.csv", "loss.png", "summary.json", "preset/config.json"):
        assert os.path.exists(tmp_path / "full" / name), name
    log = (tmp_path / "full" / "log.csv").read_text().splitlines()
    assert len(log) == 4 and log[0].startswith(
        "step,tokens,train_loss,val_loss"
    )
    # Validation perplexity falls as training goes on.
    first_val_ppl = float(log[1].split(",")[4])
    assert full["validation"]["perplexity"] < first_val_ppl


def test_standard_baseline_and_cli(tmp_path, corpus):
    data = write_corpus(tmp_path, corpus)
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "pretrain.py"),
            "--data",
            data,
            "--output",
            str(tmp_path / "std"),
            "--model",
            "standard",
            "--architecture",
            "tiny",
            "--vocabulary-size",
            "400",
            "--sequence-length",
            "16",
            "--batch-size",
            "4",
            "--steps",
            "4",
            "--checkpoint-every",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"finished": true' in done.stdout
    assert (
        "--checkpoint-every"
        in subprocess.run(
            [sys.executable, str(REPO / "recipes" / "pretrain.py"), "--help"],
            capture_output=True,
            text=True,
        ).stdout
    )
