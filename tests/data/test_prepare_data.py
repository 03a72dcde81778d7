import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from keras_mhf.data import CorpusWarning
from keras_mhf.data import PreparedCorpus
from keras_mhf.data import prepare as prepare_module
from keras_mhf.data import prepare_data
from keras_mhf.data import tokenizer_file_sha256
from keras_mhf.data import validation_score
from keras_mhf.utils import hooks
from tests.conftest import CORPUS
from tests.conftest import REPO

FRACTION = 0.2


def make_documents(count, seed=0):
    rng = np.random.default_rng(seed)
    return [
        " ".join(rng.choice(CORPUS, size=rng.integers(1, 4)))
        for _ in range(count)
    ]


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


@pytest.fixture
def tokenizer_path(tmp_path, small_proto):
    path = tmp_path / "small.model"
    path.write_bytes(small_proto)
    return str(path)


@pytest.fixture
def documents():
    return make_documents(240)


@pytest.fixture
def inputs(tmp_path, documents):
    root = tmp_path / "corpus"
    root.mkdir()
    write_jsonl(root / "part_0.jsonl", documents[:150])
    (root / "part_1.txt").write_text("\n\n".join(documents[150:]) + "\n")
    (root / "manifest.json").write_text("{}")
    return str(root)


def expected_stream(sp, texts):
    return np.concatenate([[sp.bos_id()] + sp.encode(t) for t in texts]).astype(
        "int32"
    )


def files_of(directory):
    """File name -> bytes, with the creation time taken out of the index."""
    out = {}
    for name in sorted(os.listdir(directory)):
        data = open(os.path.join(directory, name), "rb").read()
        if name == "index.json":
            index = json.loads(data)
            index.pop("created")
            data = json.dumps(index, sort_keys=True).encode()
        out[name] = data
    return out


class Killed(Exception):
    """Raised by the `"shard_written"` hook: the run stops as if killed."""


def prepare(inputs, tokenizer_path, output, stop_after_shards=None, **kwargs):
    """`prepare_data` with the tests' settings; with `stop_after_shards`, it
    is stopped, as if killed, right after that many shard files are complete
    (the `"shard_written"` hook raises), and `None` is returned."""
    kwargs = {
        "validation_fraction": FRACTION,
        "shard_tokens": 500,
        "workers": 1,
        "progress": False,
        **kwargs,
    }
    if stop_after_shards is None:
        return prepare_data(inputs, tokenizer_path, str(output), **kwargs)
    written = []

    def kill(name, **info):
        if name == "shard_written":
            written.append(info["path"])
            if len(written) >= stop_after_shards:
                raise Killed(info["path"])

    previous, hooks.event = hooks.event, kill
    try:
        return prepare_data(inputs, tokenizer_path, str(output), **kwargs)
    except Killed:
        return None
    finally:
        hooks.event = previous


def test_shards_hold_the_bos_prefixed_documents(
    tmp_path, inputs, tokenizer_path, documents
):
    import sentencepiece as spm

    index = prepare(inputs, tokenizer_path, tmp_path / "out")
    sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
    held_out = [validation_score(t) < FRACTION for t in documents]
    train = [t for t, v in zip(documents, held_out) if not v]
    validation = [t for t, v in zip(documents, held_out) if v]
    assert 0 < len(validation) < len(documents)
    corpus = PreparedCorpus(tmp_path / "out")
    for split, texts in (("train", train), ("validation", validation)):
        stream = expected_stream(sp, texts)
        assert corpus.num_tokens(split) == stream.size
        assert corpus.num_documents(split) == len(texts)
        np.testing.assert_array_equal(
            corpus.read(split, 0, stream.size), stream
        )
        shards = index["splits"][split]["shards"]
        assert [s["tokens"] for s in shards[:-1]] == [500] * (len(shards) - 1)
        assert 0 < shards[-1]["tokens"] <= 500
        assert sum(s["documents"] for s in shards) == len(texts)
    assert len(index["splits"]["train"]["shards"]) > 3
    assert index["complete"] and index["format_version"] == 1
    assert index["dtype"] == "uint16" and corpus.dtype == np.uint16
    assert index["tokenizer"]["sha256"] == tokenizer_file_sha256(tokenizer_path)
    assert (
        index["tokenizer"]["vocabulary_size"]
        == sp.get_piece_size()
        == corpus.vocabulary_size
    )
    assert index["tokenizer"]["bos_id"] == sp.bos_id() == corpus.bos_id
    assert [os.path.basename(s["path"]) for s in index["sources"]["train"]] == [
        "part_0.jsonl",
        "part_1.txt",
    ]
    assert index["validation"]["rule"] == "fraction"
    shard_files = [
        s["file"] for split in index["splits"].values() for s in split["shards"]
    ]
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        ["index.json"] + shard_files
    )
    corpus.verify_checksums()


def test_output_is_identical_for_one_and_two_workers(
    tmp_path, inputs, tokenizer_path, monkeypatch
):
    monkeypatch.setattr(prepare_module, "CHUNK_DOCUMENTS", 7)
    prepare(inputs, tokenizer_path, tmp_path / "one", workers=1)
    prepare(inputs, tokenizer_path, tmp_path / "two", workers=2)
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")


def test_workers_exit_on_their_own_and_die_on_sigterm(
    tmp_path, inputs, tokenizer_path, monkeypatch
):
    """A finished run closes its pool (the workers exit after their last
    task) instead of terminating it, which hung now and then; the workers
    do not inherit a parent's SIGTERM handler (the training run's), so that
    `terminate` on an error kills them."""
    monkeypatch.setattr(prepare_module, "CHUNK_DOCUMENTS", 7)
    real_start, pools, handlers = prepare_module._start_pool, [], []

    def start(job, dtype):
        pool = real_start(job, dtype)
        pools.append(pool)
        handlers.append(pool.apply(signal.getsignal, (signal.SIGTERM,)))
        pool.terminate = lambda: pytest.fail("a finished run terminated")
        return pool

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    monkeypatch.setattr(prepare_module, "_start_pool", start)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        prepare(inputs, tokenizer_path, tmp_path / "two", workers=2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(pools) == 1 and handlers == [signal.SIG_DFL]


@pytest.mark.parametrize("stop_after", [1, 4])
def test_an_interrupted_run_resumes_to_identical_bytes(
    tmp_path, inputs, tokenizer_path, monkeypatch, stop_after
):
    monkeypatch.setattr(prepare_module, "CHUNK_DOCUMENTS", 9)
    monkeypatch.setattr(prepare_module, "CHECKPOINT_SECONDS", 0.0)
    prepare(inputs, tokenizer_path, tmp_path / "full")
    out = tmp_path / "resumed"
    assert (
        prepare(inputs, tokenizer_path, out, stop_after_shards=stop_after)
        is None
    )
    assert not (out / "index.json").exists()
    with pytest.raises(ValueError, match="unfinished prepare_data run"):
        PreparedCorpus(out)
    index = prepare(inputs, tokenizer_path, out, workers=2)
    assert index["complete"]
    assert files_of(out) == files_of(tmp_path / "full")


def test_a_killed_process_resumes_to_identical_bytes(
    tmp_path, inputs, tokenizer_path
):
    """SIGKILL (no cleanup, unflushed buffers lost) right after the 2nd
    shard."""
    out = tmp_path / "killed"
    script = f"""
import os, signal
from keras_mhf.data import prepare
prepare.CHUNK_DOCUMENTS = 5
prepare.CHECKPOINT_SECONDS = 0.0
from keras_mhf.utils import hooks
count = [0]
def kill(name, **info):
    if name == "shard_written":
        count[0] += 1
        if count[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
hooks.event = kill
prepare.prepare_data({inputs!r}, {tokenizer_path!r}, {str(out)!r},
                     validation_fraction={FRACTION}, shard_tokens=500,
                     workers=2, progress=False)
"""
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True
    )
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()[-2000:]
    assert (out / "prepare_state.json").exists() and not (
        out / "index.json"
    ).exists()
    prepare(inputs, tokenizer_path, out)
    prepare(inputs, tokenizer_path, tmp_path / "full")
    assert files_of(out) == files_of(tmp_path / "full")


def test_a_changed_configuration_is_refused(
    tmp_path, inputs, tokenizer_path, documents, capsys
):
    import sentencepiece as spm

    out = tmp_path / "out"
    prepare(inputs, tokenizer_path, out, stop_after_shards=1)
    with pytest.raises(
        ValueError, match=r"different settings \(shard_tokens: 500 -> 400"
    ):
        prepare(inputs, tokenizer_path, out, shard_tokens=400)
    other = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(documents),
        model_writer=other,
        vocab_size=90,
        model_type="bpe",
        minloglevel=2,
    )
    (tmp_path / "other.model").write_bytes(other.getvalue())
    with pytest.raises(ValueError, match="tokenizer sha256"):
        prepare(inputs, str(tmp_path / "other.model"), out)
    with pytest.raises(ValueError, match="validation rule"):
        prepare(inputs, tokenizer_path, out, validation_fraction=0.3)
    with open(os.path.join(inputs, "part_1.txt"), "a") as f:
        f.write("\nOne more document.\n")
    with pytest.raises(
        ValueError,
        match=r"training inputs differ: .*part_1\.txt had \d+ bytes"
        r".*delete prepare_state\.json, train_\*\.bin\* and "
        r"validation_\*\.bin\* in .*out \(or the whole directory\)",
    ):
        prepare(inputs, tokenizer_path, out)
    # A finished directory: the same arguments are a no-op, others refused.
    finished = tmp_path / "finished"
    first = prepare(inputs, tokenizer_path, finished)
    before = {
        n: os.stat(finished / n).st_mtime_ns for n in os.listdir(finished)
    }
    capsys.readouterr()
    assert prepare(inputs, tokenizer_path, finished) == first
    assert "nothing to do" in capsys.readouterr().err
    assert {
        n: os.stat(finished / n).st_mtime_ns for n in os.listdir(finished)
    } == before
    with pytest.raises(
        ValueError, match="a prepared corpus made with different"
    ):
        prepare(inputs, tokenizer_path, finished, shard_tokens=1000)


def test_only_a_complete_index_makes_a_prepared_corpus(
    tmp_path, inputs, tokenizer_path
):
    out = tmp_path / "out"
    prepare(inputs, tokenizer_path, out)
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").unlink()
    with pytest.raises(
        ValueError, match="no index.json, so it is not a prepared corpus"
    ):
        PreparedCorpus(out)
    (out / "index.json").write_text(json.dumps({**index, "complete": False}))
    with pytest.raises(ValueError, match="not marked complete"):
        PreparedCorpus(out)
    (out / "index.json").write_text(json.dumps({**index, "format_version": 99}))
    with pytest.raises(
        ValueError, match="format version 99; this keras_mhf reads version 1"
    ):
        PreparedCorpus(out)
    (out / "index.json").write_text(json.dumps(index)[:-10])
    with pytest.raises(ValueError, match="is not valid JSON"):
        PreparedCorpus(out)


def test_a_truncated_shard_is_refused(tmp_path, inputs, tokenizer_path):
    out = tmp_path / "out"
    prepare(inputs, tokenizer_path, out)
    shard = out / "train_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(
        ValueError,
        match=r"train_00001\.bin has 998 bytes, expected 1000.*Re-run",
    ):
        PreparedCorpus(out)
    shard.unlink()
    with pytest.raises(ValueError, match=r"train_00001\.bin is missing"):
        PreparedCorpus(out)


def test_check_tokenizer(tmp_path, inputs, tokenizer_path, small_tokenizer):
    import sentencepiece as spm

    prepare(inputs, tokenizer_path, tmp_path / "out")
    corpus = PreparedCorpus(tmp_path / "out")
    corpus.check_tokenizer(tokenizer_path)
    corpus.check_tokenizer(open(tokenizer_path, "rb").read())
    corpus.check_tokenizer(small_tokenizer)
    corpus.check_tokenizer(
        spm.SentencePieceProcessor(model_file=tokenizer_path)
    )
    other = tmp_path / "other.model"
    other.write_bytes(open(tokenizer_path, "rb").read() + b"\0")
    expected = tokenizer_file_sha256(str(other))[:16]
    prepared = corpus.tokenizer_sha256[:16]
    with pytest.raises(
        ValueError,
        match=rf"prepared with tokenizer sha256 {prepared}\.\.\., the model's "
        rf"tokenizer is {expected}\.\.\.; re-run keras-mhf prepare",
    ):
        corpus.check_tokenizer(str(other))


def test_bad_arguments_are_refused(tmp_path, inputs, tokenizer_path):
    for workers in (0, -2):
        with pytest.raises(
            ValueError, match=rf"workers must be a positive .* got {workers}"
        ):
            prepare(inputs, tokenizer_path, tmp_path / "w", workers=workers)
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(
        ValueError, match=r"junk\.model is not a SentencePiece model"
    ):
        prepare(inputs, str(tmp_path / "junk.model"), tmp_path / "j")
    with pytest.raises(FileNotFoundError, match="No such tokenizer file"):
        prepare(inputs, str(tmp_path / "missing.model"), tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        prepare(str(tmp_path / "missing.jsonl"), tokenizer_path, tmp_path / "m")
    with pytest.raises(
        ValueError, match="validation_fraction must be between 0 and 1"
    ):
        prepare(inputs, tokenizer_path, tmp_path / "f", validation_fraction=0.0)
    (tmp_path / "full_dir").mkdir()
    (tmp_path / "full_dir" / "notes.txt").write_text("mine")
    with pytest.raises(
        ValueError, match="is not empty and holds no prepare_data run"
    ):
        prepare(inputs, tokenizer_path, tmp_path / "full_dir")


def test_empty_and_one_document_corpora_are_refused(tmp_path, tokenizer_path):
    (tmp_path / "blank.txt").write_text("  \n\n \n")
    with pytest.raises(ValueError, match="The inputs hold no documents"):
        prepare(str(tmp_path / "blank.txt"), tokenizer_path, tmp_path / "e")
    assert not (tmp_path / "e").exists()
    (tmp_path / "one.txt").write_text("Water boils at one hundred degrees.\n")
    with pytest.raises(
        ValueError, match="corpus has 1 document .*--validation"
    ):
        prepare(str(tmp_path / "one.txt"), tokenizer_path, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_separate_validation_inputs(
    tmp_path, inputs, tokenizer_path, documents
):
    import sentencepiece as spm

    held = write_jsonl(
        tmp_path / "held.jsonl", ["Held out one.", "Held out two."]
    )
    index = prepare(
        inputs, tokenizer_path, tmp_path / "out", validation_inputs=held
    )
    assert index["validation"] == {"rule": "inputs"}
    sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
    corpus = PreparedCorpus(tmp_path / "out")
    stream = expected_stream(sp, ["Held out one.", "Held out two."])
    np.testing.assert_array_equal(
        corpus.read("validation", 0, stream.size), stream
    )
    assert corpus.num_documents("train") == len(documents)
    with pytest.raises(
        ValueError, match="both a training and a validation input"
    ):
        prepare(
            inputs, tokenizer_path, tmp_path / "x", validation_inputs=inputs
        )


def test_skipped_bad_lines_are_counted_in_the_index(
    tmp_path, tokenizer_path, documents
):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, documents[:50])
    with open(path, "ab") as f:
        f.write(b'{"text": null}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:51: 'text' is null"):
        prepare(str(path), tokenizer_path, tmp_path / "fail")
    with pytest.warns(CorpusWarning) as caught:
        index = prepare(
            str(path), tokenizer_path, tmp_path / "fail", on_error="skip"
        )
    messages = " ".join(str(w.message) for w in caught)
    assert "bad.jsonl:51: 'text' is null" in messages
    assert "bad.jsonl:52: invalid JSON" in messages
    assert index["skipped_lines"] == 2
    assert sum(index["splits"][s]["documents"] for s in index["splits"]) == 50


def test_token_dtype_follows_the_vocabulary(
    tmp_path, inputs, tokenizer_path, monkeypatch
):
    assert prepare_module.token_dtype(65536) == np.uint16
    assert prepare_module.token_dtype(65537) == np.uint32
    prepare(inputs, tokenizer_path, tmp_path / "u16")
    monkeypatch.setattr(
        prepare_module, "token_dtype", lambda size: np.dtype("<u4")
    )
    index = prepare(inputs, tokenizer_path, tmp_path / "u32")
    assert index["dtype"] == "uint32"
    narrow, wide = (
        PreparedCorpus(tmp_path / "u16"),
        PreparedCorpus(tmp_path / "u32"),
    )
    assert wide.dtype == np.uint32
    assert os.path.getsize(wide.shard_paths("train")[0]) == 500 * 4
    for split in ("train", "validation"):
        size = narrow.num_tokens(split)
        np.testing.assert_array_equal(
            narrow.read(split, 0, size), wide.read(split, 0, size)
        )


def test_command_line(tmp_path, inputs, tokenizer_path, capsys):
    """`keras-mhf prepare`: its options, and the same shards as
    `prepare_data` (its console script starting in a new process is
    tests/cli/test_cli.py's)."""
    from keras_mhf.cli import main as cli

    with pytest.raises(SystemExit):
        cli.main(["prepare", "--help"])
    shown = capsys.readouterr().out
    for option in (
        "--tokenizer",
        "--output",
        "--validation-fraction",
        "--validation",
        "--shard-tokens",
        "--workers",
        "--on-error",
        "INPUT",
    ):
        assert option in shown
    assert f"{prepare_module.DEFAULT_SHARD_TOKENS:,}" in shown
    out = tmp_path / "cli"
    status = cli.main(
        [
            "prepare",
            "--tokenizer",
            tokenizer_path,
            "--output",
            str(out),
            inputs,
            "--validation-fraction",
            str(FRACTION),
            "--shard-tokens",
            "500",
            "--workers",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert status == 0, err[-2000:]
    assert "tokens/s" in err and "ETA" in err
    prepare(inputs, tokenizer_path, tmp_path / "api")
    assert files_of(out) == files_of(tmp_path / "api")


def test_command_line_errors(tmp_path, inputs, tokenizer_path, capsys):

    from keras_mhf.cli.prepare import main

    code = main(
        [
            "--tokenizer",
            tokenizer_path,
            "--output",
            str(tmp_path / "o"),
            "--workers",
            "0",
            inputs,
        ]
    )
    assert code == 1
    assert "workers must be a positive" in capsys.readouterr().err


def test_mistral_tokenizer_on_openstax_documents(
    tmp_path, mistral_model_path, openstax_dir
):
    import sentencepiece as spm

    from keras_mhf.data import read_documents

    texts = list(
        read_documents(os.path.join(openstax_dir, "train_00.jsonl"), limit=12)
    )
    source = write_jsonl(tmp_path / "few.jsonl", texts)
    held = write_jsonl(tmp_path / "held.jsonl", texts[-2:])
    write_jsonl(tmp_path / "few.jsonl", texts[:-2])
    index = prepare(
        source,
        mistral_model_path,
        tmp_path / "out",
        validation_inputs=held,
        shard_tokens=1 << 20,
        workers=2,
    )
    assert index["dtype"] == "uint16"
    assert index["tokenizer"]["vocabulary_size"] == 32768
    sp = spm.SentencePieceProcessor(model_file=mistral_model_path)
    corpus = PreparedCorpus(tmp_path / "out")
    stream = expected_stream(sp, texts[:-2])
    np.testing.assert_array_equal(corpus.read("train", 0, stream.size), stream)
    assert corpus.num_tokens("train") == stream.size


def test_the_validation_rule_is_pinned():
    # Changing it would silently move documents between splits.
    score = validation_score("The cell is the basic unit of life.")
    assert score == pytest.approx(0.3713003710740264, abs=1e-15)


def test_a_corrected_bad_line_starts_afresh(
    tmp_path, tokenizer_path, documents
):
    """A run stopped by a bad line (here a lone surrogate, which reached
    SentencePiece as a TypeError without file:line) before any shard was
    complete: the corrected input starts afresh (it was refused as "an
    unfinished run made with different settings", its files left behind),
    and ends with the bytes of a run on the corrected input alone."""
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, documents[:50])
    with open(path, "ab") as f:
        f.write(b'{"text": "bad \\ud800 text"}\n')
    output = tmp_path / "prepared"
    with pytest.raises(
        ValueError, match=r"corpus\.jsonl:51: 'text' holds a lone surrogate"
    ):
        prepare(str(path), tokenizer_path, output, shard_tokens=100_000)
    assert (output / prepare_module.STATE_FILE).exists()
    write_jsonl(path, documents[:50] + ["the fixed line"])
    index = prepare(str(path), tokenizer_path, output, shard_tokens=100_000)
    assert not (output / prepare_module.STATE_FILE).exists()
    assert not list(output.glob("*.partial"))
    expected = prepare(
        str(path), tokenizer_path, tmp_path / "clean", shard_tokens=100_000
    )
    assert index["splits"] == expected["splits"]


def test_a_changed_input_after_complete_shards_names_what_to_delete(
    tmp_path, tokenizer_path, documents, monkeypatch
):
    """Once a shard is complete, an unfinished run whose input changed is
    refused (starting afresh would drop finished work), naming the files
    to delete; nothing is removed or added."""
    monkeypatch.setattr(prepare_module, "CHUNK_DOCUMENTS", 10)
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, documents[:150])
    with open(path, "ab") as f:
        f.write(b'{"text": null}\n')
    output = tmp_path / "prepared"
    with pytest.raises(ValueError, match=r"corpus\.jsonl:151: 'text' is null"):
        prepare(str(path), tokenizer_path, output, shard_tokens=200)
    before = sorted(os.listdir(output))
    assert "train_00000.bin" in before
    write_jsonl(path, documents[:151])
    with pytest.raises(
        ValueError,
        match=r"made with different settings \(.*\)\. It stopped at "
        r".*corpus\.jsonl:151: 'text' is null, not a string\. It completed \d+ "
        r"shards, which a "
        r"fresh start would drop\. To prepare these inputs there from the "
        r"start, delete prepare_state\.json, train_\*\.bin\* and "
        r"validation_\*\.bin\* in .*prepared \(or the whole directory\)",
    ):
        prepare(str(path), tokenizer_path, output, shard_tokens=200)
    assert sorted(os.listdir(output)) == before
