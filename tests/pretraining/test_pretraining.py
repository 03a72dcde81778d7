import csv
import json
import os
import shutil
import types

import numpy as np
import pytest

from keras_mhf.data import PreparedCorpus
from keras_mhf.data import pack_documents
from keras_mhf.data import prepare_data
from keras_mhf.data import read_documents
from keras_mhf.data import validation_windows
from keras_mhf.evaluation import paper_rule
from keras_mhf.evaluation import perplexity
from keras_mhf.models import MultiHashFormerCausalLM
from keras_mhf.pretraining import RunConfig
from keras_mhf.pretraining import RunConfigError
from keras_mhf.pretraining import data as run_data
from keras_mhf.pretraining import pretrain
from keras_mhf.pretraining import tokenizer_training_sample
from tests.pretraining_helpers import CALIBRATED_RUN
from tests.pretraining_helpers import RUN
from tests.pretraining_helpers import assert_same_state
from tests.pretraining_helpers import checkpoint_variables
from tests.pretraining_helpers import compilation_cache
from tests.pretraining_helpers import prepared_corpus
from tests.pretraining_helpers import reference_run
from tests.pretraining_helpers import run_flags
from tests.pretraining_helpers import state_of
from tests.pretraining_helpers import stop_after_chunks
from tests.pretraining_helpers import write_documents
from tests.pretraining_helpers import write_tokenizer

# `RUN`'s 4 validation windows are too few to calibrate on: its finished MHF
# runs skip calibration with this warning (tested on its own).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The scoring temperature was not calibrated:UserWarning"
)


@pytest.fixture(scope="module", autouse=True)
def _compile_once(tmp_path_factory):
    with compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(prepared directory, tokenizer path), shared with the fault tests."""
    return prepared_corpus(str(tmp_path_factory.getbasetemp() / "corpus"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(state, output directory) of the uninterrupted reference run."""
    return reference_run(str(tmp_path_factory.getbasetemp()))


def read_log(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_packing_puts_bos_between_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a b"}\n{"text": "c"}\n\n{"text": "d e f"}\n')
    docs = list(read_documents(str(path)))
    assert docs == ["a b", "c", "d e f"]
    blocks = pack_documents(
        docs, lambda t: [ord(c) for c in t.replace(" ", "")], 1, 3
    )
    assert blocks.tolist() == [[1, 97, 98, 1], [99, 1, 100, 101]]


def test_a_run_streams_from_the_prepared_corpus_and_logs_each_checkpoint(
    reference, corpus
):
    _, output = reference
    with open(os.path.join(output, "summary.json")) as f:
        summary = json.load(f)
    assert summary["finished"] and summary["step"] == RUN["steps"]
    assert summary["data"] == os.path.abspath(corpus[0])
    # No tokenizer was given: the one recorded in index.json is used.
    assert summary["tokenizer"] == os.path.abspath(corpus[1])
    tokens_per_step = RUN["batch_size"] * RUN["sequence_length"]
    assert summary["tokens_seen"] == RUN["steps"] * tokens_per_step
    rows = read_log(os.path.join(output, "log.csv"))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [int(r["tokens"]) for r in rows] == [
        s * tokens_per_step for s in (1, 2, 3, 4)
    ]
    assert float(rows[-1]["val_loss"]) < float(rows[0]["val_loss"])
    for name in ("loss.png", "preset/config.json"):
        assert os.path.exists(os.path.join(output, name)), name


def test_a_finished_mhf_run_is_calibrated_on_held_out_windows(
    reference, corpus
):
    _, output = reference
    length = CALIBRATED_RUN["sequence_length"]
    batch_size = CALIBRATED_RUN["batch_size"]
    with open(os.path.join(output, "summary.json")) as f:
        summary = json.load(f)
    calibration = summary["calibration"]
    assert calibration["applied"]
    tau = summary["scoring_temperature"]
    assert tau == calibration["temperature"] and tau != 1.0
    # Fit on the first half of the 16 windows, report the second half.
    windows = summary["validation_windows"]
    assert windows["calibration_fit"] == calibration["fit_windows"] == [0, 8]
    assert windows["reported"] == [8, 16]
    assert calibration["tokens"] == 8 * length
    validation = summary["validation"]
    paper = summary["validation_paper_rule"]
    assert validation["tokens"] == paper["tokens"] == 8 * length
    assert validation["scoring_temperature"] == tau
    assert validation["paper_rule"] == paper
    assert validation["loss"] <= paper["loss"]  # held out from the fit
    # The preset stores the temperature and reproduces the reported numbers.
    lm = MultiHashFormerCausalLM.from_preset(summary["preset"])
    assert lm.scoring_temperature == tau
    blocks = validation_windows(corpus[0], length, count=16)
    reported = perplexity(lm, blocks[8:], batch_size)
    assert reported["loss"] == pytest.approx(validation["loss"], rel=1e-5)
    # log.csv scores every window under the paper's rule.
    with paper_rule(lm):
        logged = perplexity(lm, blocks, batch_size)["loss"]
    calibrated = perplexity(lm, blocks, batch_size)["loss"]
    last = float(read_log(summary["log"])[-1]["val_loss"])
    assert last == pytest.approx(logged, rel=1e-5)
    assert last != pytest.approx(calibrated, rel=1e-5)


def test_no_calibrate_keeps_the_paper_rule_and_training_is_the_same(
    tmp_path, reference, corpus, capsys
):
    output = tmp_path / "run"
    status, out, err = recipe_main(
        ["--data", corpus[0], "--output", output, "--no-calibrate"]
        + run_flags(CALIBRATED_RUN),
        capsys,
    )
    assert status == 0, err[-3000:]
    summary = json.loads(out[out.index("{") :])
    assert summary["calibration"]["applied"] is False
    assert "--no-calibrate" in summary["calibration"]["reason"]
    assert summary["scoring_temperature"] == 1.0
    lm = MultiHashFormerCausalLM.from_preset(summary["preset"])
    assert lm.scoring_temperature == 1.0
    assert summary["validation"] == summary["validation_paper_rule"]
    # Calibrating the reference run changed no checkpoint and no training
    # number: the same weights, log and paper-rule validation.
    _, calibrated = reference
    with open(os.path.join(calibrated, "summary.json")) as f:
        calibrated_summary = json.load(f)
    for name in ("loss", "perplexity", "accuracy", "ece"):
        assert summary["validation_paper_rule"][name] == pytest.approx(
            calibrated_summary["validation_paper_rule"][name], rel=1e-6
        )

    def final_weights(run):
        return checkpoint_variables(
            os.path.join(run, "checkpoints", "step_000004")
        )

    weights, expected = final_weights(output), final_weights(calibrated)
    assert sorted(weights) == sorted(expected)
    for name, value in weights.items():
        np.testing.assert_array_equal(value, expected[name])

    def without_seconds(run):
        rows = read_log(os.path.join(run, "log.csv"))
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    assert without_seconds(output) == without_seconds(calibrated)


def test_rerunning_a_finished_run_calibrates_to_the_same_temperature(
    tmp_path, reference, corpus
):
    _, source = reference
    output = tmp_path / "run"
    shutil.copytree(
        os.path.join(source, "checkpoints", "step_000004"),
        output / "checkpoints" / "step_000004",
    )
    lm, summary = pretrain(corpus[0], str(output), **CALIBRATED_RUN)
    assert summary["finished"] and summary["step"] == CALIBRATED_RUN["steps"]
    with open(os.path.join(source, "summary.json")) as f:
        first = json.load(f)
    assert summary["scoring_temperature"] == first["scoring_temperature"]
    assert lm.scoring_temperature == first["scoring_temperature"]
    assert summary["validation"]["loss"] == pytest.approx(
        first["validation"]["loss"], rel=1e-6
    )


def test_too_few_validation_windows_skip_calibration_with_a_warning(tiny_lm):
    from keras_mhf.pretraining.validation import validate_final_model

    config = RunConfig("d", "o", sequence_length=16, batch_size=4)
    rng = np.random.default_rng(0)
    data = types.SimpleNamespace(
        validation_blocks=rng.integers(3, 100, (4, 17)).astype("int32")
    )
    with pytest.warns(
        UserWarning,
        match=r"not calibrated: .* 32 predicted tokens .* --validation-blocks "
        r"14 or more",
    ):
        results = validate_final_model(config, tiny_lm, data)
    assert results["calibration"]["applied"] is False
    assert results["scoring_temperature"] == tiny_lm.scoring_temperature == 1
    assert results["validation_windows"]["reported"] == [2, 4]
    assert results["validation"]["tokens"] == 2 * 16


def test_resume_after_a_crash_gives_identical_weights(
    tmp_path, reference, corpus
):
    output = str(tmp_path / "resumed")
    with stop_after_chunks(2):
        _, crashed = pretrain(corpus[0], output, **RUN)
    assert not crashed["finished"] and crashed["step"] == 2
    lm, resumed = pretrain(corpus[0], output, **RUN)
    assert resumed["finished"]
    # Both runs started from scratch: equal to the reference run, the first
    # shows that a run is deterministic, the second that resuming is exact.
    assert_same_state(state_of(lm), reference[0])
    assert [int(r["step"]) for r in read_log(resumed["log"])] == [1, 2, 3, 4]
    # Only the last KEEP_CHECKPOINTS checkpoints are kept, nothing else.
    assert sorted(os.listdir(os.path.join(output, "checkpoints"))) == [
        "step_000003",
        "step_000004",
    ]


def test_raw_text_is_prepared_into_the_output_and_reused(tmp_path, monkeypatch):
    # Paths relative to the working directory (Orbax itself takes only
    # absolute ones): the run resolves them once, at its entry.
    monkeypatch.chdir(tmp_path)
    text = os.path.basename(write_documents(tmp_path / "docs.jsonl", count=120))
    output = tmp_path / "run"
    settings = dict(RUN, vocabulary_size=400, validation_fraction=0.2)
    settings["workers"] = 1
    with stop_after_chunks(1):
        _, first = pretrain(text, "run", **settings)
    assert first["data"] == str(output / "data")
    assert first["tokenizer"] == str(output / "tokenizer.model")
    index = output / "data" / "index.json"
    stamp = index.stat().st_mtime_ns
    shards = sorted(p.name for p in (output / "data").glob("*.bin"))
    # The tokenizer never saw held-out documents and is the corpus's.
    corpus = PreparedCorpus(first["data"])
    corpus.check_tokenizer(first["tokenizer"])

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the corpus was tokenized again")

    monkeypatch.setattr("keras_mhf.data.prepare._tokenize_all", no_tokenizing)
    monkeypatch.setattr(run_data, "train_sentencepiece", no_tokenizing)
    # Another vocabulary size cannot reuse the trained tokenizer: refused.
    with pytest.raises(RunConfigError, match="--vocabulary-size 400 to resume"):
        pretrain(text, "run", **dict(settings, vocabulary_size=500))
    _, second = pretrain(text, "run", **settings)
    assert second["finished"]
    assert index.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in (output / "data").glob("*.bin")) == shards


def test_the_tokenizer_sample_is_bounded():
    documents = (f"document {i} " * 10 for i in range(10**9))  # endless
    sample = list(
        tokenizer_training_sample(documents, max_documents=5, max_characters=10)
    )
    assert len(sample) == 1  # the first document already crosses the cap
    sample = list(
        tokenizer_training_sample(
            iter(["a", "bb", "c", "dd"]),
            max_documents=10,
            max_characters=100,
            exclude=lambda t: len(t) == 2,
        )
    )
    assert sample == ["a", "c"]


def test_a_tokenizer_that_is_not_the_corpus_one_is_refused(tmp_path, corpus):
    import sentencepiece as spm

    other = tmp_path / "other.model"
    with open(other, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(["some other text entirely"] * 20),
            model_writer=f,
            vocab_size=40,
            hard_vocab_limit=False,
            minloglevel=2,
        )
    with pytest.raises(RunConfigError, match="not the tokenizer") as error:
        pretrain(corpus[0], str(tmp_path / "run"), tokenizer=str(other), **RUN)
    assert corpus[1] in str(error.value)  # names the one to use
    assert not (tmp_path / "run").exists()


def test_a_prepared_corpus_whose_tokenizer_moved_asks_for_it(tmp_path):
    tokenizer = write_tokenizer(tmp_path / "moved.model")
    documents = write_documents(tmp_path / "docs.jsonl", count=60)
    prepare_data(
        documents,
        tokenizer,
        str(tmp_path / "prepared"),
        validation_fraction=0.2,
        workers=1,
        progress=False,
    )
    os.remove(tokenizer)
    with pytest.raises(RunConfigError, match="pass --tokenizer"):
        pretrain(str(tmp_path / "prepared"), str(tmp_path / "run"), **RUN)
    assert not (tmp_path / "run").exists()


def test_a_corpus_shorter_than_one_window_is_refused(tmp_path, corpus):
    settings = dict(RUN, sequence_length=100_000)
    with pytest.raises(
        RunConfigError, match=r"The train split of .* has \d+ tokens"
    ):
        pretrain(corpus[0], str(tmp_path / "run"), **settings)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(sequence_length=0), "--sequence-length must be an integer >= 1"),
        (dict(steps=0), "--steps must be an integer >= 1"),
        (dict(batch_size=-2), "--batch-size must be an integer >= 1"),
        (dict(checkpoint_every=0), "--checkpoint-every must be an integer"),
        (dict(validation_blocks=0), "--validation-blocks must be"),
        (dict(learning_rate=float("nan")), "--learning-rate must be a finite"),
        (dict(learning_rate=0.0), "--learning-rate must be a finite number >"),
        (dict(warmup_steps=-1), "--warmup-steps must be an integer >= 0"),
        (dict(validation_fraction=1.0), "--validation-fraction must be"),
        (dict(model="gpt"), "--model must be 'mhf' or 'standard'"),
        (dict(architecture="tiny"), "has no hash part"),
        (dict(architecture="huge_h3b5"), "Unknown architecture"),
        (dict(steps=2.5), "--steps must be an integer"),
        (dict(calibrate="yes"), "calibrate must be True or False"),
    ],
)
def test_invalid_settings_are_refused_before_anything_is_written(
    tmp_path, change, message
):
    settings = dict(RUN, **change)
    with pytest.raises(RunConfigError, match=message):
        pretrain(str(tmp_path / "missing"), str(tmp_path / "run"), **settings)
    assert not (tmp_path / "run").exists()


def test_every_problem_is_reported_at_once():
    config = RunConfig(data="d", output_dir="o", steps=0, batch_size=0)
    with pytest.raises(RunConfigError, match="--batch-size.*; --steps"):
        config.validate()


def test_a_batch_size_the_batch_axis_does_not_divide_is_refused(
    tmp_path, corpus, monkeypatch
):
    mesh = types.SimpleNamespace(shape=(4,), axis_names=("batch",))
    fake = types.SimpleNamespace(device_mesh=mesh, batch_dim_name="batch")
    monkeypatch.setattr(
        "keras_mhf.pretraining.distribution.make_distribution",
        lambda *a, **k: fake,
    )
    settings = dict(RUN, batch_size=6, distribution="data")
    with pytest.raises(RunConfigError, match="does not divide the 4-way"):
        pretrain(corpus[0], str(tmp_path / "run"), **settings)
    assert not (tmp_path / "run").exists()


def test_validation_data_is_refused_with_a_prepared_corpus(tmp_path, corpus):
    with pytest.raises(RunConfigError, match="applies to raw text"):
        pretrain(
            corpus[0],
            str(tmp_path / "run"),
            validation_data=corpus[0],
            **RUN,
        )


def recipe_main(argv, capsys):
    """`keras-mhf pretrain`'s `main(argv)` in this process: `(exit status,
    stdout, stderr)`."""
    from keras_mhf.cli import pretrain as recipe

    capsys.readouterr()
    try:
        recipe.main([str(a) for a in argv])
        status = 0
    except SystemExit as exit:
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


def test_standard_baseline_and_cli(tmp_path, corpus, capsys):
    shutil.copy(corpus[1], tmp_path / "tokenizer.model")
    status, out, err = recipe_main(
        [
            "--data",
            corpus[0],
            "--output",
            tmp_path / "std",
            "--model",
            "standard",
            "--architecture",
            "tiny",
            "--tokenizer",
            tmp_path / "tokenizer.model",
            "--sequence-length",
            16,
            "--batch-size",
            4,
            "--steps",
            2,
            "--checkpoint-every",
            2,
            "--warmup-steps",
            1,
            "--validation-blocks",
            4,
            "--quiet",
        ],
        capsys,
    )
    assert status == 0, err[-3000:]
    summary = json.loads(out[out.index("{") :])
    assert summary["finished"] and summary["model"] == "standard"
    assert os.path.exists(summary["preset"])
    assert np.isfinite(summary["validation"]["perplexity"])
    # The Standard baseline has one scoring rule: never calibrated.
    assert summary["calibration"]["applied"] is False
    assert "Standard" in summary["calibration"]["reason"]
    assert summary["scoring_temperature"] is None
    assert "validation_paper_rule" not in summary
    assert "paper_rule" not in summary["validation"]
    status, help_text, _ = recipe_main(["--help"], capsys)
    assert status == 0
    for flag in (
        "--checkpoint-every",
        "--coordinator",
        "--process-id",
        "--no-calibrate",
    ):
        assert flag in help_text
    assert "prepared corpus directory" in help_text and "raw text" in help_text


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            ["--steps", "0", "--learning-rate", "nan"],
            "error: --steps must be an integer >= 1, got 0; --learning-rate "
            "must be a finite number > 0, got nan.",
        ),
        (["--coordinator", "localhost:1"], "go together"),
        (
            [
                "--coordinator",
                "h:1",
                "--num-processes",
                "2",
                "--process-id",
                "2",
            ],
            "--process-id must be in 0..1, got 2",
        ),
    ],
)
def test_the_recipe_reports_bad_arguments_without_a_traceback(
    tmp_path, capsys, arguments, message
):
    status, _, err = recipe_main(
        ["--data", tmp_path / "corpus.txt", "--output", tmp_path / "run"]
        + arguments,
        capsys,
    )
    assert status == 2
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
